"""Chunked logprobs: the plain function's values and gradients, with memory bounded by one chunk."""

from __future__ import annotations

import pytest
import torch

from rlserve.training.forward import gather_logprobs


def plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook version: full fp32 logits, log_softmax, gather (autograd keeps [N, V])."""
    logp = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def inputs(n: int, h: int, v: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(v, h, generator=g)).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("chunk_rows", [7, 64, None])
def test_values_and_gradients_equal_the_plain_function(chunk_rows):
    hidden, weight, targets, upstream = inputs(100, 16, 50)
    lp, ent = gather_logprobs(hidden, weight, targets, chunk_rows=chunk_rows, with_entropy=True)
    (lp * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_lp, ref_ent = plain(hidden, weight, targets)
    (ref_lp * upstream).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, atol=1e-5, rtol=1e-5)
    assert not ent.requires_grad  # a metric


def test_padded_vocab_rows_take_no_mass_and_get_no_gradient():
    hidden, weight, targets, upstream = inputs(40, 8, 30)
    padded = torch.cat([weight.detach(), torch.randn(6, 8)]).requires_grad_()
    lp, _ = gather_logprobs(hidden, padded, targets, chunk_rows=16, valid_rows=30)
    (lp * upstream).sum().backward()
    ref, _ = plain(hidden.detach(), weight.detach(), targets)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(padded.grad[30:]) == 0


def test_an_empty_micro_batch_still_reaches_the_weight():
    """Dummy micro-batches (no completion tokens) must run backward for FSDP's collectives."""
    hidden, weight, targets, _ = inputs(0, 8, 30)
    lp, _ = gather_logprobs(hidden, weight, targets)
    lp.sum().backward()
    assert weight.grad is not None and torch.count_nonzero(weight.grad) == 0


def saved_bytes(fn, *tensors: torch.Tensor) -> int:
    """Bytes autograd keeps for backward beyond the inputs themselves (what a step holds until
    its backward runs), counted through saved-tensor hooks."""
    inputs_storage = {t.untyped_storage().data_ptr() for t in tensors}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs_storage:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def test_autograd_memory_stays_under_a_bound_the_plain_function_exceeds():
    n, h, v = 2048, 32, 4096
    hidden, weight, targets, _ = inputs(n, h, v)
    full_logits = n * v * 4
    bound = n * 32  # per row: the fp32 log-normaliser, the local target and its ownership flag
    ours = saved_bytes(lambda: gather_logprobs(hidden, weight, targets, chunk_rows=256, with_entropy=True),
                       hidden, weight, targets)
    textbook = saved_bytes(lambda: plain(hidden, weight, targets), hidden, weight, targets)
    # The previous chunked forward (autograd through each chunk) keeps every chunk's logits too.
    chunked_autograd = saved_bytes(
        lambda: torch.cat([plain(hidden[k:k + 256], weight, targets[k:k + 256])[0] for k in range(0, n, 256)]),
        hidden, weight, targets)
    assert ours <= bound < full_logits
    assert textbook >= full_logits and chunked_autograd >= full_logits
