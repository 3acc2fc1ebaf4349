"""Megatron-Core 0.16.1 GPTModel for an HF Llama/Mistral/Qwen2/Qwen3/Phi3/Mixtral/Qwen3-MoE config.

`megatron_config_from_hf` picks the TransformerConfig whose forward equals
the HF model's (which models qualify: `rlserve.learner.megatron.support`;
checked to 1e-4 in fp32 by `tests/distributed/test_hf_megatron.py` and
`tests/architectures/`). Qwen3's per-head q/k RMSNorm is megatron's
`qk_layernorm`; Phi3's partial rotary factor is `rotary_percent`. `build_gpt_model` builds the model
with the local layer spec (or the Transformer Engine spec on GPUs); weights
come from `rlserve.learner.megatron.hf_map.hf_to_megatron` and go in through
`load_megatron_state`.

Mixtral routing. HF (`MixtralTopKRouter`): softmax over all expert logits in
fp32, top-k, then divide by the sum of the k kept probabilities. That equals a
softmax over the k top logits, which is megatron's
`moe_router_score_function="softmax"` with `moe_router_pre_softmax=False`
(`transformer/moe/moe_utils.py`, `topk_routing_with_score_function`: top-k of
the logits, then softmax over those k). Top-1 would differ (HF weight 1.0;
megatron demands pre-softmax for k=1, giving p_max), so it is refused.
Qwen3-MoE renormalises only with `norm_topk_prob`; without it HF keeps the
top-k of the full softmax, which is `moe_router_pre_softmax=True`. Load
balancing is "none" (no forward effect either way): HF adds no router loss
unless `output_router_logits`, and NeMo-RL's MoE GRPO recipes use "none" too;
a learner that wants an aux loss overrides it. Router math is fp32
(`moe_router_dtype="fp32"`; HF takes the softmax in fp32, its logits in the
model dtype, so bf16 runs differ by rounding only). The token dispatcher is "allgather", megatron's default: it works
with TP and EP and on CPU, whereas "alltoall" builds a `torch.cuda.Stream` in
its constructor; large-EP GPU runs may override it to "alltoall".

Vocab padding: GPTModel never pads; VocabParallelEmbedding needs the vocab to
divide by TP. `build_gpt_model` uses `padded_vocab_size(hf_vocab, tp)` unless
told otherwise; the converter fills padded rows with zeros, and logits past
`hf_config.vocab_size` must be dropped before a softmax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlserve.learner.megatron.hf_map import padded_vocab_size
from rlserve.learner.megatron.support import check_supported, rope_settings
from rlserve.models.architecture import num_experts

__all__ = ["megatron_config_from_hf", "build_gpt_model", "load_megatron_state", "padded_vocab_size"]


def megatron_config_from_hf(hf_config, *, max_sequence_length: int | None = None, **overrides: Any):
    """The megatron `TransformerConfig` that reproduces `hf_config`'s forward; `overrides` win.

    Refuses (NotImplementedError) a model `rlserve.learner.megatron.support` does not
    support for sequences of up to `max_sequence_length` tokens (default: the model's context).

    Parallel sizes (`tensor_model_parallel_size`, `expert_model_parallel_size`,
    `sequence_parallel`, ...), `use_cpu_initialization` and mixed precision
    come in through `overrides`. By default params take the checkpoint dtype
    (`bf16`/`fp16` flags set to match); dropout is off as in HF.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_supported(hf_config, max_sequence_length)
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    kwargs: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2",
        qk_layernorm=hf_config.model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        init_method_std=hf_config.initializer_range,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    if num_experts(hf_config):
        # Mixtral always renormalises the top-k probabilities; Qwen-MoE only with norm_topk_prob.
        renormalised = hf_config.model_type == "mixtral" or bool(getattr(hf_config, "norm_topk_prob", False))
        kwargs.update(
            num_moe_experts=num_experts(hf_config),
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size,
            moe_grouped_gemm=False,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not renormalised,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="allgather",
            moe_permute_fusion=False,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    hf_config,
    transformer_config,
    pre_process: bool = True,
    post_process: bool = True,
    use_te: bool = False,
    *,
    vocab_size: int | None = None,
    parallel_output: bool = True,
):
    """A GPTModel (RoPE, tied embeddings as in `hf_config`) with the local spec, or the TE spec if `use_te`.

    `vocab_size` is the padded vocab (default: the HF vocab rounded up to a
    multiple of the TP size). With `parallel_output=True` the logits stay
    vocab-parallel, shape [batch, seq, padded_vocab / TP] on each TP rank.
    Parallel state (`megatron.core.parallel_state`) must be initialised.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    rope_base, rope_kwargs = rope_settings(hf_config)
    experts = transformer_config.num_moe_experts
    if experts:
        _bind_te_general_gemm_if_missing()
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=transformer_config.moe_grouped_gemm,
            qk_layernorm=transformer_config.qk_layernorm)
    else:
        if transformer_config.moe_grouped_gemm:
            raise NotImplementedError("grouped GEMM experts need the TE spec (use_te=True)")
        spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                        qk_layernorm=transformer_config.qk_layernorm)
        # The local spec's attention materialises [batch, heads, seq, seq] scores; torch's SDPA
        # runs the same maths in flash / memory-efficient kernels.
        spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    tp = transformer_config.tensor_model_parallel_size
    return GPTModel(
        config=transformer_config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp) if vocab_size is None else vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=rope_base,
        **rope_kwargs,
    )


def _bind_te_general_gemm_if_missing() -> None:
    """Work around a megatron-core 0.16.1 bug that breaks every MoE forward without Transformer Engine.

    `RouterGatingLinearFunction.forward` (transformer/moe/moe_utils.py:1192)
    tests `te_general_gemm is not None`, but the module binds that name only
    when TE imports (moe_utils.py:20-39), so without TE (CPU, or a GPU image
    without it, like the H200 test machine) the router raises NameError.
    Binding None selects the torch.mm path that the check is there for.
    Not a CPU patch: it changes nothing when TE is installed.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def load_megatron_state(model: torch.nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy a converted shard into `model`; every parameter must be covered, `_extra_state` excepted."""
    result = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise KeyError(f"Megatron state mismatch: missing {missing[:8]}, unexpected {result.unexpected_keys[:8]}")


def sdpa_attention_class():
    """Megatron's DotProductAttention computed with torch's fused attention kernels.

    Without Transformer Engine, Megatron's local layer spec attends with baddbmm + softmax + bmm
    over explicit [b, n, s, s] scores (DotProductAttention), which is slow and memory-hungry at long
    sequences. This subclass keeps its parameters, layout ([s, b, n, d] in, [s, b, n*d] out) and
    masks (None: causal; a boolean mask: True = masked out), and hands the maths to
    `torch.nn.functional.scaled_dot_product_attention`, which picks flash or memory-efficient
    kernels on GPUs. Packed rows come in Megatron's "thd" layout ([t, n, d], `PackedSeqParams`
    with the sequences' cu_seqlens; Megatron has already applied RoPE per sequence) and attend per
    sequence through `rlserve.training.attention.packed_causal_attention`, with no [t, t] mask.
    Configurations SDPA cannot express (query-key layer scaling, a learnable softmax offset,
    sliding windows, attention dropout) fall back to the parent's forward, which cannot pack.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rlserve.training.attention import packed_causal_attention

    class SdpaAttention(DotProductAttention):
        def _sdpa_ok(self) -> bool:
            cfg = self.config
            return (not cfg.apply_query_key_layer_scaling and getattr(cfg, "softmax_type", "vanilla") == "vanilla"
                    and cfg.window_size is None and not cfg.attention_dropout)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
            if not self._sdpa_ok() or attention_bias is not None or (packed_seq_params is not None and not packed):
                if packed:
                    raise NotImplementedError("packed sequences on the local spec need the SDPA-expressible "
                                              "attention (no query-key scaling, softmax offset, window or dropout)")
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            if packed:  # [t, n, d], one row of sequences back to back
                out = packed_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                              packed_seq_params.max_seqlen_q, self.softmax_scale)
                return out.reshape(out.shape[0], self.hidden_size_per_partition)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
            mask = None if attention_mask is None else ~attention_mask
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
                enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition)
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    return SdpaAttention
