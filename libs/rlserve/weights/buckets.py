"""Pack a stream of HF-named tensors into buckets of bounded bytes.

Buckets bound what the learner holds for the weight store's copy: rank 0
keeps only the bucket it is filling and puts each full one in the object
store, never the whole model at once. A tensor larger than the bound travels
alone in its own bucket.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` in host memory as `dtype`, cast on its own device first.

    `t.to("cpu", dtype)` from a GPU copies in the source dtype and converts on the host, so
    fp32 master weights exported as bf16 would move twice the bytes and then pay a CPU pass.
    From a GPU the copy lands in pinned memory: fresh pageable memory ran at 1.6 GB/s on the
    H200 machine, pinned at 55 GB/s, and torch's host allocator caches pinned blocks, so a
    bucket freed after one export serves the next (BENCHMARKS.md, weight export).
    """
    t = t.to(dtype or t.dtype)
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t)


def exported(t: torch.Tensor, dtype: torch.dtype | None, on_device: bool) -> torch.Tensor:
    """An exported tensor as `dtype`: kept on its device for a same-device handoff (`on_device`), else
    in host memory (`to_host`)."""
    return t.to(dtype or t.dtype) if on_device else to_host(t, dtype)


class BucketWriter:
    """Packs tensors, in the order added, into buckets of at most `max_bytes`; each full bucket
    goes to `emit` (the writer keeps only the bucket it is filling)."""

    def __init__(self, max_bytes: int, emit: Callable[[dict[str, torch.Tensor]], None]):
        if max_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {max_bytes}")
        self.max_bytes, self.emit = max_bytes, emit
        self.num_buckets = self.num_tensors = self.num_bytes = 0
        self._bucket: dict[str, torch.Tensor] = {}
        self._size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor_bytes(tensor)
        if self._bucket and self._size + nbytes > self.max_bytes:
            self.flush()
        self._bucket[name] = tensor
        self._size += nbytes
        self.num_tensors += 1
        self.num_bytes += nbytes

    def flush(self) -> None:
        """Emit the bucket being filled, if any (call it after the last tensor)."""
        if self._bucket:
            self.emit(self._bucket)
            self.num_buckets += 1
            self._bucket, self._size = {}, 0
