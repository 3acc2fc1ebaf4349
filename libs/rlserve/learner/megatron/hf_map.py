"""Hugging Face <-> Megatron-Core GPTModel weights, as pure tensor functions.

The project's interchange layout is HF parameter names exactly as they are in
the safetensors checkpoint (MoE experts unfused: `...experts.3.w1.weight`),
with full, unsharded tensors. Megatron-Core 0.16.1's GPTModel differs as
follows, and this module undoes it (checked against the 0.16.1 source, and by
the logits checks in `tests/distributed/test_hf_megatron.py`):

- Fused QKV, grouped per KV head (`transformer/attention.py`,
  `SelfAttention.get_query_key_value_tensors`): rows are, for each query group
  g, the r = heads/groups query heads of g, then k_g, then v_g. TP splits the
  fused rows into contiguous chunks (ColumnParallelLinear), which is whole
  groups when groups >= TP and a slice of one group otherwise (megatron then
  all-gathers and re-slices; the weight layout is the same).
- Fused gate/up (`transformer/mlp.py`: `torch.chunk(x, 2, dim=-1)`, stride 2):
  `linear_fc1` is [gate; up] and TP rank t holds [gate_t; up_t].
- Vocab-parallel embedding/output layer, padded with zero rows up to
  `padded_vocab_size` (GPTModel itself never pads; VocabParallelEmbedding
  needs the vocab to divide by TP). Row-parallel `linear_proj`/`linear_fc2`
  split on dim 1. Norms and the MoE router are replicated. RoPE is rotate-half
  in both (`rope_utils._rotate_half` with `rotary_interleaved=False`), so q/k
  rows need no permutation.

Per architecture (`_MOE_NAMES`, `_QK_NORM`, `_FUSED_HF`): Qwen2 adds q/k/v
biases (fused like the weights); Qwen3 and Qwen3-MoE add per-head q/k RMSNorm
weights (`self_attention.q_layernorm`/`k_layernorm`, replicated); Phi3's HF
checkpoint already fuses `qkv_proj` = [Q; K; V] (not grouped) and
`gate_up_proj` = [gate; up], which are split before Megatron's own fusion and
re-fused on the way back; Mixtral names experts `block_sparse_moe.experts.{e}.w1/w3/w2`
and its router `block_sparse_moe.gate`, Qwen3-MoE `mlp.experts.{e}.gate_proj/up_proj/down_proj`
and `mlp.gate` (the checkpoint's names: transformers 5 fuses experts only in memory).

Names follow the local layer spec; `use_te=True` gives the Transformer Engine
spec's names (input norm at `self_attention.linear_qkv.layer_norm_weight`,
dense pre-MLP norm at `mlp.linear_fc1.layer_norm_weight`; MoE layers keep
`pre_mlp_layernorm.weight`), and `moe_grouped_gemm=True` (TE spec only) names
experts `mlp.experts.linear_fc1.weight{j}` (TEGroupedMLP).

Expert parallelism: EP rank e holds global experts [e*n, (e+1)*n) with
n = experts/EP as local experts 0..n-1 (`moe_layer.py`, local_expert_indices);
each expert's fc1/fc2 is split over the expert-TP group (ETP, megatron's
default is ETP = TP) exactly like the dense MLP.

Tied embeddings: the HF checkpoint has no `lm_head.weight` and the GPTModel
(share_embeddings_and_output_weights=True, one pipeline stage) has no
`output_layer.weight`; neither side emits one. Pipeline parallelism is not
handled here: shards are whole-model (all layers) per TP/EP rank.

Output tensors either are an input tensor itself (nothing to reshape, e.g. a
norm weight at TP 1) or own their storage; they are never a view into a larger
buffer (torch pickles a view's whole storage). Exporters that need a snapshot
that later optimizer steps cannot change must copy.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlserve.models.architecture import num_experts

# model_type -> (MoE block prefix, router name, expert weight names (gate, up, down)) for MoE models.
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe.", "gate.weight", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.", "gate.weight", ("gate_proj", "up_proj", "down_proj")),
}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", *_MOE_NAMES)
_QK_NORM = ("qwen3", "qwen3_moe")  # per-head RMSNorm on q and k (megatron's q_layernorm / k_layernorm)
_FUSED_HF = ("phi3",)  # HF fuses qkv_proj ([Q; K; V]) and gate_up_proj ([gate; up]) itself

# How one Megatron parameter is split over its TP (or expert-TP) group.
_REPLICATED, _ROW, _VOCAB, _QKV, _FC1 = "replicated", "row", "vocab", "qkv", "fc1"


@dataclass(frozen=True)
class _Rule:
    mcore: str  # Megatron name; for experts a template whose `{j}` is the local expert index
    hf: tuple[str, ...]  # HF names this parameter is made of, in fusion order (one name: HF fused them too)
    kind: str
    expert: int | None = None  # global expert index for MoE expert weights


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 1) -> int:
    """Vocab rows Megatron holds: `vocab_size` rounded up to a multiple of `divisible_by * tp_size`.

    `divisible_by=1` pads only what TP needs (nothing for the tiny presets at
    TP 1/2); Megatron-LM's training scripts use 128. Padded rows are zero and
    their logits must be dropped (`logits[..., :vocab_size]`) before softmax.
    """
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def _is_moe(hf_config) -> bool:
    return hf_config.model_type in _MOE_NAMES


def _check_supported(hf_config) -> None:
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"HF<->Megatron conversion supports model_type in {SUPPORTED_MODEL_TYPES}, not {hf_config.model_type!r}"
        )


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def _attention_rules(model_type: str, hf: str, mc: str) -> list[_Rule]:
    attn = hf + "self_attn."
    qkv = (attn + "qkv_proj.weight",) if model_type in _FUSED_HF else \
        (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")
    rules = [
        _Rule(mc + "self_attention.linear_qkv.weight", qkv, _QKV),
        _Rule(mc + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), _ROW),
    ]
    if model_type == "qwen2":  # q/k/v biases, no o_proj bias
        rules.append(_Rule(mc + "self_attention.linear_qkv.bias",
                           (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), _QKV))
    if model_type in _QK_NORM:
        rules += [_Rule(mc + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), _REPLICATED),
                  _Rule(mc + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), _REPLICATED)]
    return rules


def _layer_rules(model_type: str, i: int, experts: int, use_te: bool, moe_grouped_gemm: bool) -> list[_Rule]:
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    rules = [_Rule(mc + ("self_attention.linear_qkv.layer_norm_weight" if use_te else "input_layernorm.weight"),
                   (hf + "input_layernorm.weight",), _REPLICATED)]
    rules += _attention_rules(model_type, hf, mc)
    if not experts:
        gate_up = (hf + "mlp.gate_up_proj.weight",) if model_type in _FUSED_HF else \
            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
        rules += [
            _Rule(mc + ("mlp.linear_fc1.layer_norm_weight" if use_te else "pre_mlp_layernorm.weight"),
                  (hf + "post_attention_layernorm.weight",), _REPLICATED),
            _Rule(mc + "mlp.linear_fc1.weight", gate_up, _FC1),
            _Rule(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), _ROW),
        ]
        return rules
    block, router, (gate, up, down) = _MOE_NAMES[model_type]
    moe = hf + block
    rules += [
        _Rule(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), _REPLICATED),
        _Rule(mc + "mlp.router.weight", (moe + router,), _REPLICATED),
    ]
    for e in range(experts):
        w = f"{moe}experts.{e}."
        # `{j}` is filled with the local expert index of the EP rank that holds expert e.
        if moe_grouped_gemm:
            fc1, fc2 = f"{mc}mlp.experts.linear_fc1.weight{{j}}", f"{mc}mlp.experts.linear_fc2.weight{{j}}"
        else:
            fc1 = f"{mc}mlp.experts.local_experts.{{j}}.linear_fc1.weight"
            fc2 = f"{mc}mlp.experts.local_experts.{{j}}.linear_fc2.weight"
        rules += [
            _Rule(fc1, (f"{w}{gate}.weight", f"{w}{up}.weight"), _FC1, expert=e),
            _Rule(fc2, (f"{w}{down}.weight",), _ROW, expert=e),
        ]
    return rules


def _rules_key(hf_config, use_te: bool, moe_grouped_gemm: bool) -> tuple:
    _check_supported(hf_config)
    if moe_grouped_gemm and not use_te:
        raise NotImplementedError("moe_grouped_gemm names are those of the TE spec (TEGroupedMLP); use use_te=True")
    experts = num_experts(hf_config) if _is_moe(hf_config) else 0
    return (hf_config.model_type, hf_config.num_hidden_layers, experts, bool(hf_config.tie_word_embeddings),
            use_te, moe_grouped_gemm)


def _rules(hf_config, use_te: bool, moe_grouped_gemm: bool) -> tuple[_Rule, ...]:
    return _rules_for(*_rules_key(hf_config, use_te, moe_grouped_gemm))


@functools.lru_cache(maxsize=32)
def _rules_for(model_type: str, layers: int, experts: int, tied: bool, use_te: bool,
               moe_grouped_gemm: bool) -> tuple[_Rule, ...]:
    rules = [_Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), _VOCAB)]
    for i in range(layers):
        rules += _layer_rules(model_type, i, experts, use_te, moe_grouped_gemm)
    rules.append(_Rule("decoder.final_layernorm.weight", ("model.norm.weight",), _REPLICATED))
    if not tied:
        rules.append(_Rule("output_layer.weight", ("lm_head.weight",), _VOCAB))
    return tuple(rules)


def _own(t: Tensor) -> Tensor:
    """`t` itself if it spans its whole storage, else a compact copy (never a view into a bigger buffer)."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.contiguous().clone() if t.is_contiguous() else t.contiguous()


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, hf_config) -> Tensor:
    groups, d = hf_config.num_key_value_heads, _head_dim(hf_config)
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    parts = [q.reshape(groups, -1, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _split_hf_qkv(qkv: Tensor, hf_config) -> list[Tensor]:
    """HF's own fused projection (Phi3 `qkv_proj`): [Q; K; V] rows, not grouped."""
    d, kv = _head_dim(hf_config), hf_config.num_key_value_heads
    return list(qkv.split([hf_config.num_attention_heads * d, kv * d, kv * d], dim=0))


def _split_qkv(fused: Tensor, hf_config) -> tuple[Tensor, Tensor, Tensor]:
    groups, d = hf_config.num_key_value_heads, _head_dim(hf_config)
    r = hf_config.num_attention_heads // groups
    tail = fused.shape[1:]
    q, k, v = fused.reshape(groups, (r + 2) * d, *tail).split([r * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _chunk(t: Tensor, parts: int, index: int, dim: int) -> Tensor:
    if t.shape[dim] % parts:
        raise ValueError(f"cannot split dim {dim} of size {t.shape[dim]} into {parts} equal TP shards")
    return t.chunk(parts, dim=dim)[index]


def _to_shard(rule: _Rule, tensors: list[Tensor], hf_config, tp_size: int, tp_rank: int, vocab_rows: int) -> Tensor:
    if rule.kind == _REPLICATED:
        return tensors[0]
    if rule.kind == _ROW:
        return _chunk(tensors[0], tp_size, tp_rank, dim=1)
    if rule.kind == _QKV:
        parts = _split_hf_qkv(tensors[0], hf_config) if len(tensors) == 1 else tensors
        return _chunk(_fuse_qkv(*parts, hf_config), tp_size, tp_rank, dim=0)
    if rule.kind == _FC1:
        gate, up = tensors[0].chunk(2, dim=0) if len(tensors) == 1 else tensors
        return torch.cat([_chunk(gate, tp_size, tp_rank, 0), _chunk(up, tp_size, tp_rank, 0)], dim=0)
    if rule.kind == _VOCAB:
        full = tensors[0]
        if vocab_rows < full.shape[0]:
            raise ValueError(f"padded vocab {vocab_rows} is smaller than the HF vocab {full.shape[0]}")
        if vocab_rows > full.shape[0]:
            full = torch.cat([full, full.new_zeros(vocab_rows - full.shape[0], *full.shape[1:])], dim=0)
        return _chunk(full, tp_size, tp_rank, dim=0)
    raise AssertionError(rule.kind)


def _from_shards(rule: _Rule, shards: Sequence[Tensor], hf_config) -> list[Tensor]:
    if rule.kind == _REPLICATED:
        return [shards[0]]
    if rule.kind == _ROW:
        return [torch.cat(list(shards), dim=1) if len(shards) > 1 else shards[0]]
    if rule.kind == _QKV:
        parts = list(_split_qkv(torch.cat(list(shards), dim=0), hf_config))
        return [torch.cat(parts, dim=0)] if len(rule.hf) == 1 else parts
    if rule.kind == _FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        parts = [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
        return [torch.cat(parts, dim=0)] if len(rule.hf) == 1 else parts
    if rule.kind == _VOCAB:
        full = torch.cat(list(shards), dim=0) if len(shards) > 1 else shards[0]
        return [full[: hf_config.vocab_size]]
    raise AssertionError(rule.kind)


def _expert_placement(hf_config, ep_size: int) -> int:
    experts = num_experts(hf_config)
    if experts % ep_size:
        raise ValueError(f"{experts} experts do not divide over expert_model_parallel_size={ep_size}")
    return experts // ep_size


def hf_to_megatron(
    hf_state: Mapping[str, Tensor],
    hf_config,
    tp_size: int,
    tp_rank: int,
    ep_size: int = 1,
    ep_rank: int = 0,
    *,
    etp_size: int | None = None,
    etp_rank: int | None = None,
    vocab_size: int | None = None,
    use_te: bool = False,
    moe_grouped_gemm: bool = False,
) -> dict[str, Tensor]:
    """The GPTModel state-dict shard of one (TP, EP) rank, from HF checkpoint-named full tensors.

    `etp_size`/`etp_rank` (expert tensor parallel) default to TP like
    megatron's `expert_tensor_parallel_size`. `vocab_size` is the padded vocab
    the GPTModel was built with (default `padded_vocab_size(hf_vocab, tp_size)`).
    The shard has no `_extra_state` entries; load it with
    `rlserve.learner.megatron.model.load_megatron_state`. Raises on missing or
    unexpected HF names (a rotary `inv_freq` buffer, if present, is ignored).
    """
    etp_size = tp_size if etp_size is None else etp_size
    etp_rank = tp_rank if etp_rank is None else etp_rank
    vocab_rows = padded_vocab_size(hf_config.vocab_size, tp_size) if vocab_size is None else vocab_size
    rules = _rules(hf_config, use_te, moe_grouped_gemm)
    local = _expert_placement(hf_config, ep_size) if _is_moe(hf_config) else 0

    used = {name for rule in rules for name in rule.hf}
    ignorable = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    unexpected = sorted(
        k for k in hf_state if k not in used and k not in ignorable and not k.endswith("rotary_emb.inv_freq")
    )
    missing = sorted(used - set(hf_state))
    if unexpected or missing:
        raise KeyError(f"HF state does not match the {hf_config.model_type} config: "
                       f"missing {missing[:8]}, unexpected {unexpected[:8]}")

    out: dict[str, Tensor] = {}
    for rule in rules:
        tensors = [hf_state[name] for name in rule.hf]
        if rule.expert is None:
            out[rule.mcore] = _own(_to_shard(rule, tensors, hf_config, tp_size, tp_rank, vocab_rows))
        elif rule.expert // local == ep_rank:
            name = rule.mcore.format(j=rule.expert % local)
            out[name] = _own(_to_shard(rule, tensors, hf_config, etp_size, etp_rank, vocab_rows))
    return out


def _global_rule_index(hf_config, use_te: bool, moe_grouped_gemm: bool, ep_size: int) -> dict[tuple[str, int], _Rule]:
    """(Megatron name as held by an EP rank, that EP rank) -> rule."""
    return _index_for(_rules_key(hf_config, use_te, moe_grouped_gemm), ep_size)


@functools.lru_cache(maxsize=32)
def _index_for(key: tuple, ep_size: int) -> dict[tuple[str, int], _Rule]:
    experts = key[2]
    local = experts // ep_size if experts else 0
    if experts and experts % ep_size:
        raise ValueError(f"{experts} experts do not divide over expert_model_parallel_size={ep_size}")
    index = {}
    for rule in _rules_for(*key):
        if rule.expert is None:
            for e in range(ep_size):
                index[(rule.mcore, e)] = rule
        else:
            index[(rule.mcore.format(j=rule.expert % local), rule.expert // local)] = rule
    return index


def megatron_param_to_hf(
    name: str,
    tp_shards: Sequence[Tensor],
    hf_config,
    *,
    ep_size: int = 1,
    ep_rank: int = 0,
    use_te: bool = False,
    moe_grouped_gemm: bool = False,
) -> list[tuple[str, Tensor]]:
    """HF `(name, full tensor)` pairs made from one Megatron parameter.

    `name` is the parameter's name in the GPTModel state dict of EP rank
    `ep_rank` (local expert index, global layer index); `tp_shards` are its
    pieces from every rank of its TP group in rank order (the expert-TP group
    for expert weights), or a single full tensor. Replicated parameters use
    `tp_shards[0]`. This is the per-parameter primitive for a distributed
    exporter: all-gather one parameter over its group (`tp_split_dim` says
    along which dim), convert, bucket, free, next.
    """
    try:
        rule = _global_rule_index(hf_config, use_te, moe_grouped_gemm, ep_size)[(name, ep_rank)]
    except KeyError:
        raise KeyError(
            f"{name!r} is not a {hf_config.model_type} GPTModel parameter (ep_rank {ep_rank} of {ep_size})"
        ) from None
    tensors = _from_shards(rule, tp_shards, hf_config)
    return [(hf_name, _own(t)) for hf_name, t in zip(rule.hf, tensors)]


def dense_linears(hf_config) -> dict[str, tuple[str, ...]]:
    """The TP-split linear layers of a decoder layer that are not MoE experts, as LoRA adapts them: their
    path in the layer (`self_attention.linear_qkv`, ...) -> the HF module leaf names fused into each, in
    fusion order (`("q_proj", "k_proj", "v_proj")`; one name where HF fuses them too, as Phi3's `qkv_proj`)."""
    out = {}
    for rule in _rules(hf_config, use_te=False, moe_grouped_gemm=False):
        if rule.expert is None and rule.kind in (_QKV, _ROW, _FC1) and rule.mcore.endswith(".weight") \
                and rule.mcore.startswith("decoder.layers.0."):
            path = rule.mcore.removeprefix("decoder.layers.0.").removesuffix(".weight")
            out[path] = tuple(name.rsplit(".", 2)[-2] for name in rule.hf)
    return out


def moe_expert_leaves(hf_config) -> tuple[str, ...]:
    """The HF leaf names of an MoE model's expert linears (gate, up, down); () for a dense model."""
    return _MOE_NAMES[hf_config.model_type][2] if _is_moe(hf_config) else ()


def _dense_rule(name: str, hf_config) -> _Rule:
    try:
        return _global_rule_index(hf_config, False, False, 1)[(name, 0)]
    except KeyError:
        raise KeyError(f"{name!r} is not a {hf_config.model_type} GPTModel parameter") from None


def hf_names(name: str, hf_config) -> tuple[str, ...]:
    """The HF names that dense (not expert) GPTModel parameter `name` is made of, in fusion order."""
    return _dense_rule(name, hf_config).hf


def hf_rows(name: str, hf_config) -> tuple[int, ...]:
    """The rows (output features) of each HF tensor that column-parallel dense parameter `name` is made of."""
    rule = _dense_rule(name, hf_config)
    d, heads, kv = _head_dim(hf_config), hf_config.num_attention_heads, hf_config.num_key_value_heads
    if rule.kind == _QKV:
        rows = (heads * d, kv * d, kv * d)
    elif rule.kind == _FC1:
        rows = (hf_config.intermediate_size,) * 2
    else:
        raise ValueError(f"{name!r} is not a column-parallel linear that fuses HF tensors")
    return rows if len(rule.hf) == len(rows) else (sum(rows),)


def row_sources(name: str, hf_config, tp_size: int, tp_rank: int) -> Tensor:
    """For each row of TP rank `tp_rank`'s shard of column-parallel parameter `name`, the index (in
    `hf_names` order) of the HF tensor it comes from: the fusion map applied to row labels."""
    labels = [torch.full((n,), i) for i, n in enumerate(hf_rows(name, hf_config))]
    return hf_to_shard(name, labels, hf_config, tp_size, tp_rank)


def hf_to_shard(name: str, tensors: Sequence[Tensor], hf_config, tp_size: int, tp_rank: int) -> Tensor:
    """TP rank `tp_rank`'s shard of dense GPTModel parameter `name`, made from its HF tensors in `hf_names` order.

    Only the rows (fused, split) or the columns (split) are rearranged, so any tensor laid out like the
    weight along that dim converts: a LoRA B [out, r] of a column-parallel layer, an A [r, in] of a
    row-parallel one (`rlserve.learner.megatron.lora`), a vector of row labels (`row_sources`).
    `megatron_param_to_hf` is the inverse.
    """
    return _own(_to_shard(_dense_rule(name, hf_config), list(tensors), hf_config, tp_size, tp_rank, 0))


_LAYER_RE = re.compile(r"^decoder\.layers\.\d+\.")


def tp_split_dim(name: str) -> int | None:
    """The dim along which a GPTModel parameter is split over TP (ETP for experts), None if replicated.

    For a gather before `megatron_param_to_hf`; megatron also marks each
    parameter (`tensor_model_parallel`, `partition_dim` attributes).
    """
    if name.endswith(("layernorm.weight", "layer_norm_weight", "router.weight")):
        return None
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")) or re.search(r"linear_fc2\.weight\d+$", name):
        return 1
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") or _LAYER_RE.match(name):
        return 0
    raise KeyError(f"{name!r} is not a GPTModel parameter this module converts")
