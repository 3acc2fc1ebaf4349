"""What rlserve reads from an HF model's config to compute exactly what its ForCausalLM computes.

The learner and the reference run the HF decoder (`model.model`) and project
only the scored positions onto the vocabulary themselves (memory: see
`rlserve.training.forward`). Whatever the model's own `ForCausalLM.forward`
does after `lm_head` must then be done here too, or the logprobs are not the
model's: Gemma2/Gemma3 cap the final logits (`cap * tanh(logits / cap)`),
Cohere multiplies them by `logit_scale`, Granite divides them by
`logits_scaling`. And a model whose attention itself needs the eager kernel
(Gemma2's attention-logit soft-capping, which transformers' SDPA path skips)
is loaded with it, so the learner, the reference and the transformers engine
agree with vLLM, which applies the cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor


@dataclass(frozen=True)
class OutputLogits:
    """The post-processing of `hidden @ lm_head.T` in the model's ForCausalLM: scale, then soft-cap."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_config(cls, config) -> OutputLogits:
        scale = 1.0
        if getattr(config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
            scale *= float(config.logit_scale)
        if getattr(config, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
            scale /= float(config.logits_scaling)
        cap = getattr(config, "final_logit_softcapping", None)
        return cls(scale=scale, softcap=float(cap) if cap else None)

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, logits: Tensor) -> Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def attn_implementation(config) -> str | None:
    """The attention kernel the model needs to be itself, or None for transformers' default (SDPA)."""
    if getattr(config, "attn_logit_softcapping", None):
        return "eager"  # SDPA has no soft-capping: transformers' SDPA path silently drops it
    return None


def load_causal_lm(path: Path | str, dtype: torch.dtype, attn: str | None = None) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained` with the attention kernel the architecture needs.

    `attn` is the caller's preferred kernel (for example the dtensor learner's maskless one), used
    only when the architecture does not need a particular one.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    impl = attn_implementation(AutoConfig.from_pretrained(path)) or attn
    kwargs = {"attn_implementation": impl} if impl else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)


def num_experts(config) -> int:
    """Routed experts per MoE layer (Mixtral says `num_local_experts`, Qwen-MoE `num_experts`); 0 if dense."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)
