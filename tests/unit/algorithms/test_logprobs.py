"""Chunked token logprobs and entropy against plain torch.log_softmax."""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.algorithms.logprobs import entropy_from_logits, token_logprobs


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])
def test_token_logprobs_values_and_gradients(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (3, 5), generator=g)
    upstream = torch.randn(3, 5, generator=g, dtype=torch.float64)

    got = token_logprobs(logits, targets, chunk_size=chunk_size)
    (got.double() * upstream).sum().backward()
    got_grad, logits.grad = logits.grad, None

    expected = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    (expected * upstream).sum().backward()

    assert got.shape == targets.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, logits.grad, rtol=1e-6, atol=1e-6)


def test_token_logprobs_bf16_logits_fp32_result():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 50, generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (10,), generator=g)
    got = token_logprobs(logits, targets, chunk_size=3)
    got.sum().backward()
    assert got.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    reference_logits = logits.detach().float().requires_grad_()
    expected = torch.log_softmax(reference_logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    expected.sum().backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(logits.grad.float(), reference_logits.grad, rtol=1e-2, atol=1e-2)


def test_token_logprobs_with_masked_vocab_entries():
    logits = torch.tensor([[0.0, float("-inf"), math.log(3.0)]], requires_grad=True)
    got = token_logprobs(logits, torch.tensor([2]), chunk_size=1)
    got.sum().backward()
    torch.testing.assert_close(got, torch.tensor([math.log(0.75)]))
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.25, 0.0, 0.25]]))


def test_entropy_from_logits():
    g = torch.Generator().manual_seed(2)
    logits = 2 * torch.randn(4, 6, 9, generator=g, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    expected = -(p * p.log()).sum(-1)
    got = entropy_from_logits(logits, chunk_size=5)
    assert got.shape == (4, 6) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    # Uniform over 8 tokens -> log 8; a -inf logit is a zero-probability token, not a NaN.
    special = torch.tensor([[0.0] * 8, [0.0, 0.0] + [float("-inf")] * 6]).to(torch.bfloat16)
    torch.testing.assert_close(entropy_from_logits(special), torch.tensor([math.log(8.0), math.log(2.0)]))
