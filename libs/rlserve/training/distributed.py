"""Process-group set-up shared by the learner's Ray workers, tests and GPU benchmarks.

On one machine the rendezvous goes through a file (no TCP listener at all)
and gloo/NCCL sockets use the loopback interface, so nothing listens beyond
this host. Across machines the caller passes a tcp:// init method.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def device_for(device: str, local_rank: int) -> torch.device:
    """Resolve `cluster.device` ("auto", "cpu", "cuda") for this rank."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.device is 'cuda' but CUDA is not available on this worker")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(rank: int, world_size: int, init_method: str, device: torch.device,
                       timeout_s: float = 600.0) -> None:
    if dist.is_initialized():
        return
    if init_method.startswith("file://"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
