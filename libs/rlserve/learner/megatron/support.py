"""Which HF models the megatron backend reproduces exactly, decided from the HF config alone.

The coordinator asks this at `SubmitRun` (a refused model is FAILED_PRECONDITION
naming the reason and the alternative, before anything starts) and the backend
asks it again before it builds anything. A model passes only where
`megatron_config_from_hf` + the local/TE layer spec compute the HF model's own
forward (checked to 1e-4 in fp32 per architecture by
`tests/architectures/test_architectures.py`):

- Llama/Mistral (SwiGLU, RMSNorm, rotate-half RoPE, llama3 RoPE scaling with
  megatron's hard-coded factors), Qwen2 (q/k/v biases), Qwen3 (per-head q/k
  RMSNorm: megatron's `qk_layernorm`), Phi3 (HF's fused `qkv_proj` and
  `gate_up_proj` are split by the converter), Mixtral and Qwen3-MoE (all
  layers MoE, softmax routing; top-k renormalised or not).
- Not Gemma2/Gemma3: their (1 + w) RMSNorm, sqrt(hidden)-scaled embeddings,
  pre/post sandwich norms, GeLU-tanh MLP, attention and final-logit
  soft-capping and per-layer sliding windows have no GPTModel setting.
- LoRA (`policy.megatron_cfg.peft`) on any HF module of the attention and
  dense MLP layers (`rlserve.learner.megatron.lora.layer_targets`), on the
  local layer spec; not on MoE experts.
- Not a sliding window shorter than the run's sequences: the window is not
  mapped. Packed rows attend per sequence through
  `rlserve.training.attention` (causal, no window), and megatron-core 0.16.1's
  own windowed path on the local spec applies its window mask in place of the
  attention mask it is given (`FusedScaleMaskSoftmax.forward_torch_softmax`);
  the Transformer Engine path is unverified here. A window at least as long
  as the longest sequence of the run changes nothing and passes.
"""

from __future__ import annotations

from typing import Any

from rlserve.config.spec import RunSpec
from rlserve.learner.megatron.hf_map import SUPPORTED_MODEL_TYPES
from rlserve.learner.megatron.lora import layer_targets
from rlserve.learner.registry import UnsupportedModel
from rlserve.models.architecture import OutputLogits, num_experts

ALTERNATIVE = "train it with the dtensor backend (policy.dtensor_cfg.enabled: true, the default)"

_NO_GPTMODEL_EQUIVALENT = {
    "gemma2": "Gemma2's (1 + w) RMSNorm, scaled embeddings, sandwich norms, GeLU-tanh MLP, attention and "
              "final-logit soft-capping and alternating sliding windows have no Megatron-Core GPTModel setting",
    "gemma3_text": "Gemma3's (1 + w) RMSNorm, scaled embeddings, sandwich norms, GeLU-tanh MLP, local/global "
                   "RoPE bases and sliding windows have no Megatron-Core GPTModel setting",
}


def rope_settings(hf_config) -> tuple[float, dict[str, Any]]:
    """(rope base, GPTModel rope kwargs) from either the transformers-5 or the 4.x config fields."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = params if params else (getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise NotImplementedError("the HF config has no rope_theta")
    partial = float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))
    kwargs: dict[str, Any] = {"rotary_percent": partial}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), kwargs
    # megatron's llama3 scaling hard-codes low=1, high=4, original context 8192 (RotaryEmbedding._apply_scaling).
    if rope_type == "llama3" and (
        scaling.get("low_freq_factor"), scaling.get("high_freq_factor"), scaling.get("original_max_position_embeddings")
    ) == (1.0, 4.0, 8192):
        return float(theta), {**kwargs, "rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}
    raise NotImplementedError(f"rope type {rope_type!r} with {scaling} has no Megatron GPTModel equivalent here")


def sliding_window(hf_config) -> int | None:
    """The attention window the HF model applies, or None (Qwen2/3 only with `use_sliding_window`)."""
    window = getattr(hf_config, "sliding_window", None)
    if hf_config.model_type.startswith("qwen") and not getattr(hf_config, "use_sliding_window", False):
        return None
    return window


def unsupported_reasons(hf_config, max_sequence_length: int | None = None) -> list[str]:
    """Why the megatron backend would not compute this model's forward (empty: it would).

    `max_sequence_length` is the run's longest sequence (default: the model's context).
    """
    kind = hf_config.model_type
    if kind in _NO_GPTMODEL_EQUIVALENT:
        return [_NO_GPTMODEL_EQUIVALENT[kind]]
    if kind not in SUPPORTED_MODEL_TYPES:
        return [f"model_type {kind!r} has no HF<->Megatron map (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"]
    reasons = []
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        reasons.append(f"hidden_act {hf_config.hidden_act!r}: only SwiGLU (silu) MLPs map onto GPTModel")
    if kind in ("llama", "mistral") and (getattr(hf_config, "attention_bias", False)
                                         or getattr(hf_config, "mlp_bias", False)):
        reasons.append("attention_bias/mlp_bias on a Llama-style model are not mapped")
    if kind == "qwen3" and getattr(hf_config, "attention_bias", False):
        reasons.append("Qwen3 attention_bias is not mapped")
    window = sliding_window(hf_config)
    length = max_sequence_length or hf_config.max_position_embeddings
    if window is not None and window < length:
        reasons.append(f"sliding_window {window} is shorter than the run's sequences ({length} tokens): the megatron "
                       f"backend attends causally over whole sequences (windows are not mapped)")
    if not OutputLogits.from_config(hf_config).identity:
        reasons.append("final-logit soft-capping/scaling is not applied by the megatron loss")
    try:
        rope_settings(hf_config)
    except NotImplementedError as err:
        reasons.append(str(err))
    if num_experts(hf_config):
        reasons += _moe_reasons(hf_config)
    return reasons


def _moe_reasons(hf_config) -> list[str]:
    reasons = []
    renormalised = hf_config.model_type == "mixtral" or bool(getattr(hf_config, "norm_topk_prob", False))
    if renormalised and hf_config.num_experts_per_tok < 2:
        reasons.append("top-1 routing renormalised to weight 1.0 has no Megatron router setting")
    if getattr(hf_config, "decoder_sparse_step", 1) != 1 or getattr(hf_config, "mlp_only_layers", None):
        reasons.append("dense layers between MoE layers (decoder_sparse_step/mlp_only_layers) are not mapped")
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        reasons.append("shared experts are not mapped")
    return reasons


def _refusal(hf_config, reasons: list[str]) -> str:
    return f"the megatron backend cannot train this {hf_config.model_type} model: {'; '.join(reasons)}; {ALTERNATIVE}"


def check_supported(hf_config, max_sequence_length: int | None = None) -> None:
    """Raise NotImplementedError naming every reason and the alternative, if the backend cannot train it."""
    reasons = unsupported_reasons(hf_config, max_sequence_length)
    if reasons:
        raise NotImplementedError(_refusal(hf_config, reasons))


def check_model(spec: RunSpec, hf_config) -> None:
    """Raise UnsupportedModel (naming the field and the alternative) if the backend cannot train it as configured."""
    reasons = unsupported_reasons(hf_config, spec.policy.max_total_sequence_length)
    if reasons:
        raise UnsupportedModel("policy.megatron_cfg", _refusal(hf_config, reasons))
    cfg = spec.policy.megatron_cfg
    if cfg.peft.enabled:
        if cfg.transformer_impl == "transformer_engine":
            raise UnsupportedModel("policy.megatron_cfg.transformer_impl", "LoRA adapts the local layer spec's "
                                   "linear layers; the Transformer Engine spec fuses the input norms into "
                                   "linear_qkv and linear_fc1, whose normalised input an adapter needs; use "
                                   "transformer_impl: local (or auto, which picks local with LoRA)")
        layer_targets(hf_config, cfg.peft, "policy.megatron_cfg.peft")
