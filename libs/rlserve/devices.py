"""Device names ("auto", "cpu", "cuda") to torch devices: the one place an in-process model picks one.

Inside a Ray replica or actor, CUDA_VISIBLE_DEVICES lists the GPUs Ray gave it, so "cuda" is the
first of them. A replica that got no GPU (num_gpus 0) still sees every GPU of its node (Ray 2.60
leaves CUDA_VISIBLE_DEVICES alone then), which is why the services pass "cpu" or "cuda" from what
Ray assigned (`rlserve.cluster.deployment.assigned_device`) rather than "auto".
"""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """"auto": CUDA when this process sees a GPU, else CPU; "cuda" fails without one."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' asked for, but this process sees no GPU")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
