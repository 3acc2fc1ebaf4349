"""LoRA adapters on a transformers model through `peft`: which layers, the adapter's names, on and off.

The spec names target modules by the model's own module names (`q_proj`, ...,
`down_proj` for Llama-shaped models); `match_all_linear` adapts every linear
layer of the decoder layers (attention and MLP), never the embeddings or the
head. What leaves the learner is a PEFT adapter (`rlserve.weights.adapter`:
the layout `peft` and vLLM load).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlserve.config.policy import LoraCfg
from rlserve.config.spec import RunSpec
from rlserve.weights import adapter


class LoraMismatch(ValueError):
    """The LoRA section does not fit the model; `field` names the key to change."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers of the first decoder layer by leaf name (every layer has the same)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        raise ValueError(f"{type(model).__name__}: expected an HF decoder-only model with model.layers")
    return {name.rsplit(".", 1)[-1]: m for name, m in layers[0].named_modules() if isinstance(m, nn.Linear)}


def target_modules(cfg: LoraCfg, linears: dict[str, nn.Linear], key: str) -> list[str]:
    """The leaf names to adapt; LoraMismatch for a name the model lacks or a rank wider than a layer."""
    missing = [n for n in cfg.target_modules + cfg.exclude_modules if n not in linears]
    if missing:
        field = "target_modules" if missing[0] in cfg.target_modules else "exclude_modules"
        raise LoraMismatch(f"{key}.{field}", f"{missing[0]!r} is not a linear layer of this model's decoder "
                           f"layers (they have: {', '.join(sorted(linears))})")
    names = sorted(linears) if cfg.match_all_linear and not cfg.target_modules else list(cfg.target_modules)
    names = [n for n in names if n not in cfg.exclude_modules]
    if not names:
        raise LoraMismatch(f"{key}.exclude_modules", "excludes every target: no layer would be adapted")
    for name in names:
        width = min(linears[name].in_features, linears[name].out_features)
        if cfg.dim > width:
            raise LoraMismatch(f"{key}.dim", f"{cfg.dim} exceeds the width of {name} ({linears[name].in_features}"
                               f" -> {linears[name].out_features}); use dim <= {width}")
    return names


def check_lora(spec: RunSpec, hf_config: Any) -> list[str]:
    """The modules a run's LoRA section adapts in this model, checked from its config alone (a model on
    the meta device); [] without LoRA. LoraMismatch when the section does not fit."""
    cfg = spec.policy.lora
    if not cfg.enabled:
        return []
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return target_modules(cfg, decoder_linears(model), spec.policy.lora_key)


def adapter_config(cfg: LoraCfg, targets: list[str], base_model: str) -> dict[str, Any]:
    """The PEFT `adapter_config.json` of an adapter trained with `cfg`."""
    return adapter.adapter_config(cfg.dim, cfg.alpha, cfg.dropout, targets, base_model)


def read_adapter_for(folder: Path, config: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """The PEFT-named tensors of the adapter in `folder`, refused unless it has the rank and targets of
    `config` (this run's adapter config; None: the run trains without LoRA)."""
    if config is None:
        raise ValueError(f"{folder} is a LoRA adapter, and this run trains without LoRA")
    tensors, theirs = adapter.read_adapter(folder)
    if (theirs.get("r"), sorted(theirs.get("target_modules") or [])) != (config["r"], sorted(config["target_modules"])):
        raise ValueError(f"{folder}: an adapter of rank {theirs.get('r')} on {theirs.get('target_modules')}, "
                         f"not this run's rank {config['r']} on {config['target_modules']}")
    return tensors


def inject(model: nn.Module, cfg: LoraCfg, targets: list[str]) -> None:
    """Add adapters to `model` in place (B = 0: the model computes exactly what it did); only they train."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=cfg.dim, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                       target_modules=targets, bias="none"), model)
    for name, param in model.named_parameters():
        param.requires_grad = ".lora_" in name


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter layer of `model` skipped (the reference policy of a LoRA run).

    Only the layers' switch is flipped. peft's `enable_adapters(False)` also clears the adapters'
    requires_grad, and FSDP2 fixes which parameters need gradients at its first forward, which may
    be this one: the adapters would then never train.
    """
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False
