"""A rank's trained state in one file, fast: what a learner that heals its workers restores.

A checkpoint (`checkpoint.py`) goes through torch distributed checkpoint,
which reshards on load and costs a large part of a LoRA step (56-82% on an
H200, 18-52% on CPU: `scripts/bench/snapshot.py`). A snapshot is restored into
the same worker layout only, so each rank writes its own shards: the
trainable parameters and the optimizer state, packed on the device into one
flat tensor per dtype, copied in one transfer into host buffers kept between
snapshots (pinned on a GPU: a fresh pageable buffer costs more than the rest
together) and written as raw bytes, beside a small file of where each tensor
is, random state, lr schedule and version. DTensors are written as their local
shards and rebuilt on the restored parameters' meshes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# A tensor's place in the packed buffers: (its dtype's buffer, offset, shape).
Slot = tuple[str, int, tuple[int, ...]]


def _file(path: Path, dtype: str | None = None) -> Path:
    return path / (f"snapshot_rank{dist.get_rank()}.{dtype}.bin" if dtype else f"snapshot_rank{dist.get_rank()}.pt")


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _pack(tensors: dict[tuple, torch.Tensor], host: dict[str, torch.Tensor]
          ) -> tuple[dict[str, torch.Tensor], dict[tuple, Slot]]:
    """One flat host tensor per dtype (concatenated where the tensors live, copied into `host`'s buffer of
    that dtype, replaced when the size changes), and each tensor's slot."""
    by_dtype: dict[str, list[tuple[tuple, torch.Tensor]]] = {}
    for key, t in tensors.items():
        by_dtype.setdefault(str(t.dtype).removeprefix("torch."), []).append((key, t))
    buffers, slots = {}, {}
    for dtype, items in by_dtype.items():
        offset = 0
        for key, t in items:
            slots[key] = (dtype, offset, tuple(t.shape))
            offset += t.numel()
        flat = torch.cat([t.reshape(-1) for _, t in items])
        if flat.device.type == "cpu":
            buffers[dtype] = flat
            continue
        buf = host.get(dtype)
        if buf is None or buf.numel() != flat.numel():
            buf = host[dtype] = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        buffers[dtype] = buf.copy_(flat)
    return buffers, slots


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict,
         host: dict[str, torch.Tensor]) -> None:
    """`host`: the buffers this rank's snapshots reuse (the caller keeps it between calls)."""
    tensors = {("param", n): _local(p) for n, p in model.named_parameters() if p.requires_grad}
    optim = optimizer.state_dict()
    scalars = {}
    for i, state in optim["state"].items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                tensors[("optim", i, k)] = _local(v)
            else:
                scalars[(i, k)] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
    buffers, slots = _pack(tensors, host)
    path.mkdir(parents=True, exist_ok=True)
    for dtype, buf in buffers.items():
        buf.view(torch.uint8).numpy().tofile(_file(path, dtype))
    torch.save({"dtypes": {d: str(b.dtype) for d, b in buffers.items()}, "slots": slots, "scalars": scalars,
                "param_groups": optim["param_groups"], **extra}, _file(path))


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore parameters and optimizer in place; returns the rest of what `save` was given."""
    saved = torch.load(_file(path), weights_only=False)
    slots = saved.pop("slots")
    buffers = {d: torch.from_file(str(_file(path, d)), size=_file(path, d).stat().st_size, dtype=torch.uint8)
               .view(getattr(torch, name.removeprefix("torch."))) for d, name in saved.pop("dtypes").items()}

    def tensor(key: tuple) -> torch.Tensor:
        dtype, offset, shape = slots[key]
        n = 1
        for d in shape:
            n *= d
        return buffers[dtype][offset:offset + n].view(shape)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                _local(p).copy_(tensor(("param", name)))
    order = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict] = {}
    for key in slots:
        if key[0] == "optim":
            _, i, k = key
            p = order[i]
            v = tensor(key).to(p.device)
            state.setdefault(i, {})[k] = (DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                                             shape=p.shape, stride=p.stride())
                                          if isinstance(p, DTensor) else v)
    for (i, k), v in saved.pop("scalars").items():
        state.setdefault(i, {})[k] = v
    optimizer.load_state_dict({"state": state, "param_groups": saved.pop("param_groups")})
    return saved
