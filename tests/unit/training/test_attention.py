"""Packed attention without a mask: each sequence attends only to itself, RoPE restarts, and a
transformers model running it gives each sequence's own logits (CPU: the per-sequence fallback)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rlserve.training.attention import (
    cu_seqlens_of,
    hf_packed_attention,
    packed_causal_attention,
    register_hf_attention,
    unsupported_reason,
)

LENGTHS = [5, 1, 9, 3]


def masked_reference(q, k, v, lengths, scale):
    """Dense attention over the whole row with an explicit block-diagonal causal mask."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    t = q.shape[0]
    allowed = torch.ones(t, t, dtype=torch.bool).tril() & (seg[:, None] == seg[None, :])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_packed_attention_equals_the_block_diagonal_mask_with_gqa():
    g = torch.Generator().manual_seed(0)
    t = sum(LENGTHS)
    q, k, v = torch.randn(t, 4, 8, generator=g), torch.randn(t, 2, 8, generator=g), torch.randn(t, 2, 8, generator=g)
    out = packed_causal_attention(q, k, v, cu_seqlens_of(LENGTHS), max(LENGTHS), 0.3)
    torch.testing.assert_close(out, masked_reference(q, k, v, LENGTHS, 0.3), atol=1e-5, rtol=1e-5)


def test_sequences_of_equal_length_batched_together_keep_their_own_outputs_and_gradients():
    """The CPU path attends all sequences of one length in one call: interleaved lengths, repeats and
    one-token sequences give the block-diagonal mask's outputs and gradients, in row order."""
    lengths = [5, 1, 9, 3, 5, 5, 1, 9, 2, 5]
    g = torch.Generator().manual_seed(1)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    out = packed_causal_attention(q, k, v, cu_seqlens_of(lengths), max(lengths), 0.3)
    ref = masked_reference(q, k, v, lengths, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    weights = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def tiny_model():
    config = LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_hf_attention()).eval()


def test_transformers_model_packed_and_right_padded_rows_equal_each_sequence_alone():
    model = tiny_model()
    seqs = [torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
        cu = cu_seqlens_of(LENGTHS)
        packed = model(input_ids=torch.cat(seqs)[None],
                       position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None],
                       cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS),
                       max_length_k=max(LENGTHS)).logits[0]
        rows = torch.zeros(len(seqs), max(LENGTHS), dtype=torch.long)
        for i, s in enumerate(seqs):
            rows[i, :len(s)] = s
        padded = model(input_ids=rows).logits
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([padded[i, :n] for i, n in enumerate(LENGTHS)]), alone,
                               atol=1e-5, rtol=1e-5)


def test_a_mask_or_an_unsupported_attention_feature_is_refused():
    import pytest

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="takes no mask"):
        hf_packed_attention(torch.nn.Module(), q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="soft-capping"):
        hf_packed_attention(torch.nn.Module(), q, q, q, None, softcap=50.0)
    assert unsupported_reason(LlamaConfig()) is None
    assert "soft-capping" in unsupported_reason(LlamaConfig(attn_logit_softcapping=50.0))
    assert "sliding" in unsupported_reason(LlamaConfig(sliding_window=128))


def test_cu_seqlens():
    assert cu_seqlens_of(LENGTHS).tolist() == [0, 5, 6, 15, 18]
    assert cu_seqlens_of(LENGTHS).dtype == torch.int32
