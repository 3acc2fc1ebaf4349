"""Decode-step attention that reads each key/value head once, for the compiled decode loop (`hf_decode`).

transformers' sdpa attention, given a mask (a left-padded batch always has one), copies every key/value head once
per query head that shares it (`repeat_kv`) before calling SDPA, because SDPA's grouped-query mode falls back to
its slowest kernel with a mask on CUDA. In a decode step over a static cache that copy is most of the step's
memory traffic: the 1b preset's 16 query heads over 8 key/value heads, 128 rows of a 576-token cache, write and
read again 9.7 GB a step, against 1.8 GB of weights and 4.8 GB of cache read.

A decode step has one query position, so the query heads that share a key/value head can instead be laid out as
that head's query positions: `[rows, heads, 1, dim]` viewed as `[rows, kv_heads, groups, dim]`, with the row's
mask repeated over them. SDPA then attends each key/value head once, with no copy; each query still has its own
softmax, so the result is the same attention. Every other call (a prefill, no grouping, a position bias) is
transformers' sdpa attention unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

NAME = "rlserve_grouped_decode"


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [rows, heads, q, dim], key and value
    [rows, kv_heads, kv, dim] -> ([rows, q, heads, dim], no weights)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or kv_heads == heads or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    groups = heads // kv_heads
    mask = None if attention_mask is None else attention_mask.expand(rows, 1, groups, attention_mask.shape[-1])
    out = functional.scaled_dot_product_attention(query.reshape(rows, kv_heads, groups, dim), key, value,
                                                  attn_mask=mask, dropout_p=0.0, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


def register() -> str:
    """Registers the attention under NAME (with sdpa's masks) and returns NAME, for `set_attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
