"""Causal attention over packed rows, per sequence, with memory linear in the row length.

A packed row holds several sequences back to back; each token may attend only
to earlier tokens of its own sequence. An explicit block-diagonal [T, T] mask
says that, but it costs O(T^2) memory and turns off the fused kernels (measured
on an H200, one layer over a 32k-token pack: 102 ms and 4.6 GiB with the mask,
against a few ms and ~1 GiB for document-masked kernels). Here the sequences
are described by their cumulative lengths `cu_seqlens` (int32 [n + 1], 0 first,
the row length last) and the longest length, both known on the host when the
micro-batch is built, so nothing here syncs with the device.

- CUDA, bf16/fp16: `torch.nn.attention.varlen.varlen_attn` (FlashAttention's
  variable-length kernel, forward and backward; GQA without repeating K/V).
- Anywhere else (CPU, fp32): causal SDPA over the sequences, one batched call per
  distinct length; the same maths, memory linear in the row. An RL micro-batch
  packs hundreds of short sequences of a few distinct lengths, and a call per
  sequence spent most of a CPU training step in Python (the demo: 256 sequences
  of 8 lengths, 5.5x slower per layer; bit-identical outputs and gradients).

Two front ends use it: `hf_packed_attention`, registered in transformers'
`AttentionInterface` under HF_ATTENTION for the dtensor backend (rows arrive as
[1, heads, T, dim] with `cu_seq_lens_q` / `max_length_q` among the model's
keyword arguments, the names transformers' own flash path uses), and the
Megatron local spec's core attention (`rlserve.learner.megatron.model`), which
receives Megatron's "thd" layout with `PackedSeqParams`.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
import torch.nn.functional as F

HF_ATTENTION = "rlserve_packed"


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    """int32 [n + 1] cumulative lengths (0 first), the layout the varlen kernels take."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float | None) -> torch.Tensor:
    """Causal attention within each sequence of a packed row: [T, Hq, D] x [T, Hkv, D] -> [T, Hq, D].

    Hkv may divide Hq (grouped-query attention).
    """
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_attn() is not None:
        return _varlen(query, key, value, cu_seqlens.to(query.device, torch.int32), max_seqlen, scale)
    return _per_sequence(query, key, value, cu_seqlens, scale)


@cache
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9: the per-sequence fallback
        return None
    return varlen_attn


def _varlen(query, key, value, cu_seqlens, max_seqlen, scale):
    fn = _varlen_attn()
    params = inspect.signature(fn).parameters
    # The causal flag moved into `window_size` (-1, 0) after torch 2.9; GQA needs an explicit flag
    # from the release that added it (earlier ones hand Hkv < Hq straight to the flash kernel).
    kwargs = {"scale": scale}
    kwargs.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    if "enable_gqa" in params and key.shape[1] != query.shape[1]:
        kwargs["enable_gqa"] = True
    return fn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


def _per_sequence(query, key, value, cu_seqlens, scale):
    """Causal SDPA within each sequence, batched over the sequences of each length: gathered into
    [n, H, L, D], attended in one call, put back in row order."""
    bounds = cu_seqlens.tolist()
    gqa = key.shape[1] != query.shape[1]
    starts_by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)
    outs, order = [], []
    for length, starts in starts_by_length.items():
        rows = (torch.tensor(starts)[:, None] + torch.arange(length)).reshape(-1).to(query.device)
        q, k, v = (t.index_select(0, rows).view(len(starts), length, *t.shape[1:]).transpose(1, 2)
                   for t in (query, key, value))  # [n, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(len(rows), *out.shape[1:2], out.shape[-1]))
        order.append(rows)
    placed = torch.cat(order)
    inverse = torch.empty_like(placed)
    inverse[placed] = torch.arange(len(placed), device=placed.device)
    return torch.cat(outs).index_select(0, inverse)


def unsupported_reason(hf_config) -> str | None:
    """Why `hf_packed_attention` cannot stand in for `hf_config`'s attention, or None if it can."""
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and getattr(hf_config, "use_sliding_window", True):
        return f"sliding-window attention ({window})"
    if float(getattr(hf_config, "attention_dropout", 0.0) or 0.0):
        return "attention dropout"
    return None


def hf_packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (query [B, Hq, L, D] -> [B, L, Hq, D]) with no mask at all.

    Packed rows (`cu_seq_lens_q` given) attend per sequence. Other rows get plain causal SDPA:
    rlserve's micro-batches are right-padded, so under the causal order no real token sees the
    padding after it, and padding positions are never scored; no [B, 1, L, L] mask is built.
    """
    if attention_mask is not None:
        raise ValueError(f"{HF_ATTENTION} attention takes no mask (right-padded or packed rows only)")
    if dropout or kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise NotImplementedError(f"{HF_ATTENTION} attention: no dropout, soft-capping or sliding window")
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, dropout=0.0, scaling=scaling, is_causal=True)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row, got {query.shape[0]}")
    out = packed_causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                  cu_seqlens, int(kwargs["max_length_q"]), scaling)
    return out[None], None


def register_hf_attention() -> str:
    """Make HF_ATTENTION a valid `attn_implementation` for transformers models (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, hf_packed_attention)
    return HF_ATTENTION
