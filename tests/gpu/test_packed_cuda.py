"""GPU-only: the CUDA kernels behind packing and logprobs. FlashAttention's varlen kernel gives
the per-sequence fallback's outputs and gradients (bf16, GQA), and the chunked logprobs' peak
memory over forward + backward stays near one chunk where the plain function holds all logits.
Skipped without CUDA (see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from rlserve.training.attention import _per_sequence, cu_seqlens_of, packed_causal_attention
from rlserve.training.forward import LOGITS_BUDGET_BYTES, gather_logprobs

pytestmark = pytest.mark.gpu


def test_varlen_kernel_matches_the_per_sequence_fallback():
    lengths = [700, 1, 2049, 33, 1200]
    g = torch.Generator(device="cuda").manual_seed(0)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (16, 8, 8))
    cu = cu_seqlens_of(lengths).cuda()
    upstream = torch.randn(t, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    results = []
    for fn in (lambda: packed_causal_attention(q, k, v, cu, max(lengths), 0.088),
               lambda: _per_sequence(q, k, v, cu, 0.088)):
        out = fn()
        grads = torch.autograd.grad((out.float() * upstream.float()).sum(), (q, k, v))
        results.append((out, *grads))
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2e-2)


def peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_chunked_logprobs_peak_memory_is_about_one_chunk():
    n, h, v = 8192, 2048, 151936  # a 16k-token pack's completions, a Qwen-sized vocabulary
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (0.02 * torch.randn(v, h, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda")

    def ours():
        lp, _ = gather_logprobs(hidden, weight, targets, with_entropy=True)
        lp.sum().backward()

    def plain():
        logp = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
        logp.gather(-1, targets[:, None]).sum().backward()

    grads = 2 * (hidden.numel() + weight.numel()) + 4 * weight.numel()  # bf16 grads, fp32 accumulator
    ours_peak = peak_extra_bytes(ours)
    hidden.grad = weight.grad = None
    plain_peak = peak_extra_bytes(plain)
    assert ours_peak <= grads + 4 * LOGITS_BUDGET_BYTES
    assert plain_peak > n * v * 4  # at least the full fp32 logits
