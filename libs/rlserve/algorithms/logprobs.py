"""Token log-probabilities and entropies from logits, in bounded memory.

A micro-batch's logits are rows x vocab (for a 150k vocab, 4096 rows are 2.4 GB
in fp32). A plain `log_softmax(logits.float())` makes one more fp32 copy of all
of it and autograd keeps it for the backward pass. Here the work goes row chunk
by row chunk, so the extra memory is one chunk x vocab in fp32, in the forward
and the backward pass alike. The learner and the reference service share these.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(logits)[target] per row, forward and backward in row chunks.

    Only the per-row logsumexp (rows floats) is kept for the backward pass,
    which recomputes each chunk's softmax: d logp / d logits = onehot - softmax.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, chunk_size: int) -> Tensor:  # type: ignore[override]
        rows = logits.shape[0]
        logsumexp = logits.new_empty(rows, dtype=torch.float32)
        logprobs = logits.new_empty(rows, dtype=torch.float32)
        for start in range(0, rows, chunk_size):
            chunk = logits[start:start + chunk_size].float()
            logsumexp[start:start + chunk_size] = torch.logsumexp(chunk, dim=-1)
            target_logits = chunk.gather(-1, targets[start:start + chunk_size, None]).squeeze(-1)
            logprobs[start:start + chunk_size] = target_logits - logsumexp[start:start + chunk_size]
        ctx.save_for_backward(logits, targets, logsumexp)
        ctx.chunk_size = chunk_size
        return logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, targets, logsumexp = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            grad = grad_logprobs[start:end, None].float()
            chunk_grad = -torch.exp(logits[start:end].float() - logsumexp[start:end, None]) * grad
            chunk_grad.scatter_add_(-1, targets[start:end, None], grad)
            grad_logits[start:end] = chunk_grad
        return grad_logits, None, None


def token_logprobs(logits: Tensor, targets: Tensor, chunk_size: int = 4096) -> Tensor:
    """log softmax(logits)[..., targets] in fp32, shape of `targets`; differentiable.

    logits [..., vocab], targets [...] (long). Memory beyond the logits and their
    gradient is one chunk of `chunk_size` rows x vocab in fp32.
    """
    vocab = logits.shape[-1]
    flat = _ChunkedTokenLogprobs.apply(logits.reshape(-1, vocab), targets.reshape(-1), chunk_size)
    return flat.reshape(targets.shape)


def entropy_from_logits(logits: Tensor, chunk_size: int = 4096) -> Tensor:
    """Entropy -sum p log p of softmax(logits) per position, fp32, shape logits.shape[:-1].

    For the "policy/entropy" metric: call it under `torch.no_grad()`. Computed
    in fp32 because bf16 softmax tails lose most of the entropy of a peaked
    distribution; chunked for the memory reason in the module docstring.
    """
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    entropy = rows.new_empty(rows.shape[0], dtype=torch.float32)
    for start in range(0, rows.shape[0], chunk_size):
        logp = torch.log_softmax(rows[start:start + chunk_size].float(), dim=-1)
        # A -inf logit (a masked vocab entry) has p = 0; clamping its log p keeps 0 * log p at 0, not NaN.
        entropy[start:start + chunk_size] = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(dim=-1)
    return entropy.reshape(logits.shape[:-1])
