"""Split a stream of HF-named tensors into buckets of bounded bytes.

Buckets bound the memory a weight transfer needs on both sides: the learner
materialises one bucket of full tensors at a time, the generator applies one
at a time. A tensor larger than the bound travels alone in its own bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    if max_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {max_bytes}")
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket
