"""Per-tensor digests of weights: what proves that an engine serves, bit for bit, what a learner exported.

Weights travel by several roads (the object store, vLLM's transfer engines, a
same-GPU CUDA IPC handoff), and a road that rounds, reorders or drops a tensor
still generates plausible text. Comparing logprobs within a tolerance misses a
last-bit difference; these digests do not. A digest covers the dtype, the shape
and the raw bytes, so tensors compare only in the same dtype: cast the expected
side to the engine's dtype first (a cast is exact and deterministic).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of dtype, shape and bytes (of a copy on the host: the tensor may live on a GPU)."""
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}:{list(t.shape)};".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weight_digests(named_tensors: Iterable[tuple[str, torch.Tensor]],
                   dtype: torch.dtype | None = None) -> dict[str, str]:
    """Name -> digest of each tensor, cast to `dtype` first when given."""
    return {name: tensor_digest(t if dtype is None else t.to(dtype)) for name, t in named_tensors}


def folder_digests(model_dir: str | Path, dtype: torch.dtype | None = None) -> dict[str, str]:
    """`weight_digests` of every tensor in a folder of *.safetensors (a learner's saved or exported policy)."""
    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update(weight_digests(((name, f.get_tensor(name)) for name in f.keys()), dtype))
    return out


def differences(expected: dict[str, str], served: dict[str, str]) -> list[str]:
    """What differs, for an error message (empty: bit-exact): missing, extra and changed tensors."""
    problems = [f"{name}: missing" for name in sorted(expected.keys() - served.keys())]
    problems += [f"{name}: not expected" for name in sorted(served.keys() - expected.keys())]
    problems += [f"{name}: differs" for name in sorted(expected.keys() & served.keys())
                 if expected[name] != served[name]]
    return problems
