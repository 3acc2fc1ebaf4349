"""The compiled decode loop's parts. Its draw (`rlserve.rollout.hf_decode.draw`): the cut it samples from is
transformers' own (temperature, then top-k, then top-p, as its warpers apply them), its exponential race samples
that distribution's frequencies, and the logprob it reports is the raw distribution's, before any cut. Its decode
attention (`grouped_decode_attention`): a decode step's grouped-query heads attend without copying keys and
values, to the same result as transformers' sdpa attention, and every other call is sdpa's own."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from rlserve.rollout import grouped_decode_attention
from rlserve.rollout.hf_decode import draw


def logits(rows: int = 6, vocab: int = 40) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def transformers_cut(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                             (0.7, 5, 0.8)])
def test_draws_follow_transformers_cut_distribution_and_report_raw_logprobs(temperature, top_k, top_p):
    x = logits()
    want = transformers_cut(x.clone(), temperature, top_k, top_p)
    torch.manual_seed(1)
    draws = 20_000
    counts = torch.zeros_like(want)
    for _ in range(draws // 500):
        tokens, logprobs = draw(x.repeat(500, 1), temperature, top_k, top_p)
        counts.index_put_((torch.arange(x.shape[0]).repeat(500), tokens[:, 0]), torch.ones(len(tokens)),
                          accumulate=True)
        torch.testing.assert_close(logprobs[:, 0], x.log_softmax(-1).repeat(500, 1).gather(1, tokens)[:, 0])
    assert (counts[want == 0] == 0).all(), "a token the cut removes was drawn"
    # Each frequency within 5 standard errors of its probability (binomial, 20,000 draws a row).
    se = (want * (1 - want) / draws).sqrt()
    assert ((counts / draws - want).abs() <= 5 * se + 1e-4).all()


def test_temperature_zero_is_greedy():
    x = logits()
    tokens, logprobs = draw(x, 0.0, 5, 0.5)
    assert tokens[:, 0].tolist() == x.argmax(-1).tolist()
    torch.testing.assert_close(logprobs[:, 0], x.log_softmax(-1).max(-1).values)


class Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def test_decode_steps_attend_grouped_heads_without_copies_to_sdpas_result(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    g = torch.Generator().manual_seed(0)
    rows, kv_heads, length, dim = 5, 2, 24, 8
    query = torch.randn(rows, kv_heads * 3, 1, dim, generator=g)
    key, value = (torch.randn(rows, kv_heads, length, dim, generator=g) for _ in range(2))
    mask = torch.rand(rows, 1, 1, length, generator=g) > 0.3  # left padding and unwritten cache slots
    mask[:, :, :, 0] = True
    want, _ = sdpa.sdpa_attention_forward(Attention(), query, key, value, mask, scaling=dim ** -0.5)

    def copying(*args, **kwargs):
        raise AssertionError("a decode step went through repeat_kv")

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", copying)
    got, _ = grouped_decode_attention.attention(Attention(), query, key, value, mask, scaling=dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_a_prefill_is_sdpas_own():
    import transformers.integrations.sdpa_attention as sdpa

    g = torch.Generator().manual_seed(1)
    query = torch.randn(2, 6, 7, 8, generator=g)
    key, value = (torch.randn(2, 2, 7, 8, generator=g) for _ in range(2))
    mask = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 1, 7, 7)
    want, _ = sdpa.sdpa_attention_forward(Attention(), query, key, value, mask)
    got, _ = grouped_decode_attention.attention(Attention(), query, key, value, mask)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
