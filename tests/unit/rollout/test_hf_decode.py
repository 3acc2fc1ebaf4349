"""The compiled decode loop's draw (`rlserve.rollout.hf_decode.draw`): the cut it samples from is transformers'
own (temperature, then top-k, then top-p, as its warpers apply them), its exponential race samples that
distribution's frequencies, and the logprob it reports is the raw distribution's, before any cut."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

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
