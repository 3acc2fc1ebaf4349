"""What a model's weights look like on disk, and whether an update fits them.

Engines must never apply a weight update that does not match the running
model: a failed reload can leave vLLM's engine broken. So every
update is checked here first, against the names and shapes of the model's
own safetensors checkpoint (the project's interchange layout).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from rlserve.dtypes import safetensors_dtype


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def checkpoint_specs(model_dir: str | Path) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of every tensor in a folder of *.safetensors files (headers only)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files")
    specs = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                specs[name] = TensorSpec(tuple(sl.get_shape()), safetensors_dtype(sl.get_dtype()))
    return specs


def fingerprint(specs: dict[str, TensorSpec]) -> str:
    """A short hash of names and shapes (not dtypes): equal for models one can swap weights between."""
    h = hashlib.sha256()
    for name in sorted(specs):
        h.update(f"{name}:{specs[name].shape};".encode())
    return h.hexdigest()[:16]


def check_update(expected: dict[str, TensorSpec], got: dict[str, TensorSpec], complete: bool = True) -> list[str]:
    """Problems with an update (empty list: it fits). Float dtypes may differ (they are cast)."""
    problems = []
    for name, spec in got.items():
        want = expected.get(name)
        if want is None:
            problems.append(f"{name}: not a parameter of the served model")
        elif spec.shape != want.shape:
            problems.append(f"{name}: shape {list(spec.shape)} != served {list(want.shape)}")
        elif not spec.dtype.is_floating_point:
            problems.append(f"{name}: dtype {spec.dtype} is not a floating-point type")
    if complete:
        missing = sorted(set(expected) - set(got))
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            problems.append(f"missing {len(missing)} tensors: {shown}")
    return problems


def checked(source: Iterable[tuple[str, torch.Tensor]], meta: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's tensors, each checked against what the workers were told to expect (`meta`: vLLM's
    `ParamMeta`s, or anything with name, dtype and shape).

    Workers size their receive buffers from the metadata; a tensor that differs
    would be received into the wrong buffer, so it is an error naming the first
    divergence instead.
    """
    n = 0
    for name, tensor in source:
        if n >= len(meta):
            raise ValueError(f"the weight source yielded more tensors than its metadata declared ({len(meta)}): {name}")
        want = meta[n]
        if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise ValueError(f"weight source disagrees with its metadata at {n}: declared {want.name} "
                             f"{want.dtype} {want.shape}, got {name} {tensor.dtype} {tuple(tensor.shape)}")
        n += 1
        yield name, tensor
    if n != len(meta):
        raise ValueError(f"the weight source yielded {n} tensors, its metadata declared {len(meta)}")
