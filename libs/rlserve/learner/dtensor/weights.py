"""Export of the dtensor backend: HF checkpoint-named full tensors, one parameter at a time.

The model is an HF model, so parameter names are HF names once the wrapper
prefixes are removed; `DTensor.full_tensor()` gathers each one over its mesh.
Every rank walks every parameter (the gathers are collective); only rank 0
copies to host memory.

In-memory names are not always checkpoint names (transformers 5 fuses MoE
experts): such a parameter goes through `rlserve.models.checkpoint_layout`
and must come out as names of the model's checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from rlserve.models.checkpoint_layout import to_checkpoint
from rlserve.weights import adapter
from rlserve.weights.buckets import exported


def hf_name(name: str) -> str:
    """The HF name of a parameter of `PolicyLogprobs` (activation checkpointing wraps layers)."""
    return name.removeprefix("lm.").replace("._checkpoint_wrapped_module", "")


def export_weights(model: nn.Module, lm: nn.Module, export_names: set[str], tied: bool,
                   dtype: torch.dtype | None, on_device: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    rank0 = dist.get_rank() == 0
    for name, param in model.named_parameters():
        name = hf_name(name)
        if name == "lm_head.weight" and tied:
            continue
        full = (param.full_tensor() if isinstance(param, DTensor) else param).detach()
        parts = {name: full} if name in export_names else to_checkpoint(lm, name, full)
        unknown = sorted(set(parts) - export_names)
        if unknown:
            raise ValueError(f"{name}: exports as {unknown[:4]}, not in the model's checkpoint layout")
        for part, tensor in parts.items():
            yield part, exported(tensor, dtype, on_device) if rank0 else torch.empty(0)


def export_adapter(model: nn.Module, dtype: torch.dtype | None, on_device: bool = False
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA run's adapter tensors, PEFT-named (the base never changes, so it never travels)."""
    rank0 = dist.get_rank() == 0
    for name, param in model.named_parameters():
        if not adapter.is_adapter_param(name):
            continue
        full = (param.full_tensor() if isinstance(param, DTensor) else param).detach()
        yield adapter.peft_name(hf_name(name)), exported(full, dtype, on_device) if rank0 else torch.empty(0)


def load_adapter(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Full adapter tensors (parameter names without the wrapper prefixes) into the sharded parameters."""
    from torch.distributed.tensor import distribute_tensor

    params = {hf_name(n): p for n, p in model.named_parameters() if adapter.is_adapter_param(n)}
    if set(params) != set(tensors):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise ValueError(f"the adapter does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            value = tensors[name].to(param.dtype)
            if isinstance(param, DTensor):
                value = distribute_tensor(value.to(param.device_mesh.device_type), param.device_mesh, param.placements)
            param.copy_(value)
