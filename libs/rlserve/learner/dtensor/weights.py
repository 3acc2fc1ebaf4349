"""Export of the dtensor backend: HF-named full tensors, one parameter at a time.

The model is an HF model, so parameter names already are HF names (after the
wrapper prefixes are removed); `DTensor.full_tensor()` gathers each one over
its mesh. Every rank walks every parameter (the gathers are collective); only
rank 0 copies to host memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from rlserve.weights.buckets import to_host


def hf_name(name: str) -> str:
    """The checkpoint name of a parameter of `PolicyLogprobs` (activation checkpointing wraps layers)."""
    return name.removeprefix("lm.").replace("._checkpoint_wrapped_module", "")


def export_weights(model: nn.Module, export_names: set[str], tied: bool,
                   dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    rank0 = dist.get_rank() == 0
    for name, param in model.named_parameters():
        name = hf_name(name)
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if name not in export_names:
            if name == "lm_head.weight" and tied:
                continue
            raise ValueError(f"{name}: not in the model's checkpoint layout; the dtensor backend exports "
                             f"dense HF models (fused-expert MoE needs the megatron backend)")
        yield name, to_host(full.detach(), dtype) if rank0 else torch.empty(0)
