"""A transformers model's in-memory parameters <-> the checkpoint's tensor names, both ways.

transformers 5 changes some layouts when it loads a checkpoint: it fuses MoE
experts (Mixtral's `block_sparse_moe.experts.{e}.w1/w3` become one
`mlp.experts.gate_up_proj` [E, 2I, H]; Qwen-MoE's `experts.{e}.gate_proj/up_proj`
likewise) and renames some modules. rlserve's interchange layout is the
checkpoint's (what vLLM loads and what the weight-update check compares with),
so the dtensor learner's export and the transformers engine's in-place update
translate. Both directions use transformers' own `revert_weight_conversion`,
the function `save_pretrained` writes checkpoints with: export applies it to a
parameter; import applies it to a tensor of the parameter's flat indices, which
says where each checkpoint tensor's elements go (the conversions only move
elements), so no mapping is written here by hand.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def to_checkpoint(model: nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint-named tensors that in-memory parameter `name` of `model` is made of.

    Each is a compact copy when the conversion splits the parameter (a view would pickle the
    whole fused storage); a parameter stored as it is comes back as `{name: tensor}`.
    """
    from transformers.core_model_loading import revert_weight_conversion

    parts = revert_weight_conversion(model, {name: tensor})
    if list(parts) == [name]:
        return {name: tensor}
    return {k: v.contiguous().clone() for k, v in parts.items()}


@torch.no_grad()
def load_from_checkpoint(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy checkpoint-named tensors into `model`'s parameters in place (tied weights follow).

    Raises KeyError naming checkpoint tensors that belong to no parameter of `model`.
    """
    left = dict(state)
    for name, param in model.named_parameters():
        if name in left:
            param.copy_(left.pop(name).to(param.dtype))
            continue
        index = to_checkpoint(model, name, torch.arange(param.numel(), device=param.device).view(param.shape))
        if not index.keys() & left.keys():
            continue
        flat = param.view(-1)
        for part, positions in index.items():
            if part in left:
                flat[positions.reshape(-1)] = left.pop(part).reshape(-1).to(device=flat.device, dtype=flat.dtype)
    if left:
        raise KeyError(f"checkpoint tensors that are no parameter of the {type(model).__name__}: {sorted(left)[:8]}")
