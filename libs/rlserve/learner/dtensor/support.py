"""Which dtensor layouts a model allows, decided from its HF config (asked at SubmitRun and by the backend).

The dtensor backend runs the model's own transformers code, so every
architecture transformers has trains; what can be refused is a tensor-parallel
degree. Attention heads are split by whole heads and KV groups
(`parallelize.apply_tp`): the TP degree must divide both counts. With fewer KV
heads than TP ranks a rank would need a copy of a KV head that several ranks
update, which this plan does not do (Megatron-Core replicates KV groups over TP:
`policy.megatron_cfg`). Models whose attention or MLP has fused projections
(Phi3) keep those blocks whole on every TP rank, so they need no divisibility.
"""

from __future__ import annotations

from rlserve.config.policy import DTensorCfg
from rlserve.config.spec import RunSpec
from rlserve.learner.registry import UnsupportedModel

# HF model types whose attention block fuses q/k/v into one projection (kept whole under TP).
FUSED_ATTENTION = ("phi3",)


def unsupported_reasons(hf_config, cfg: DTensorCfg) -> list[str]:
    """Why `cfg`'s layout cannot split this model (empty: it can)."""
    tp = cfg.tensor_parallel_size
    if tp == 1 or hf_config.model_type in FUSED_ATTENTION:
        return []
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    reasons = []
    if kv < tp:
        reasons.append(f"policy.dtensor_cfg.tensor_parallel_size {tp} exceeds the model's {kv} KV heads (the "
                       f"dtensor plan splits whole KV heads; use tensor_parallel_size <= {kv} with more data "
                       f"parallelism, or policy.megatron_cfg, which replicates KV groups over TP)")
    elif kv % tp or heads % tp:
        reasons.append(f"policy.dtensor_cfg.tensor_parallel_size {tp} must divide the attention heads ({heads}) "
                       f"and KV heads ({kv})")
    return reasons


def check_model(spec: RunSpec, hf_config) -> None:
    """Raise UnsupportedModel when `policy.dtensor_cfg`'s layout cannot split this model."""
    reasons = unsupported_reasons(hf_config, spec.policy.dtensor_cfg)
    if reasons:
        raise UnsupportedModel("policy.dtensor_cfg.tensor_parallel_size", "; ".join(reasons))
