"""Per-token logprobs (and entropy) of completion tokens from hidden states, with bounded memory.

Only the positions that predict a completion token are projected onto the
vocabulary, a chunk of rows at a time, so the temporary fp32 logits stay
within a fixed budget (LOGITS_BUDGET_BYTES) whatever the batch, the sequence
length and the vocabulary. Autograd would keep every chunk's logits for the
backward pass (the whole [N, V] in fp32, and more); `ChunkedLogprobs` keeps
only one log-normaliser per row and recomputes each chunk's logits in backward
(the fused linear + cross-entropy pattern), so the peak extra memory of forward
and backward is about one chunk.

The same function serves a vocabulary split over tensor-parallel ranks
(Megatron's vocab-parallel output layer): each rank projects onto its own
vocabulary rows and the per-row statistics (log-normaliser, target logit,
entropy term) are combined with two small all-reduces, so the full vocabulary
is never gathered and backward needs no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LOGITS_BUDGET_BYTES = 2**30


def completion_positions(completion_mask: torch.Tensor) -> torch.Tensor:
    """Mask over hidden-state positions [B, L]: position t predicts token t+1, so shift by one."""
    select = torch.zeros_like(completion_mask, dtype=torch.bool)
    select[:, :-1] = completion_mask[:, 1:].bool()
    return select


def default_chunk_rows(vocab_rows: int) -> int:
    """The most rows whose fp32 logits fit LOGITS_BUDGET_BYTES: few, large matmuls for big
    vocabularies, one for small ones."""
    return max(256, LOGITS_BUDGET_BYTES // (4 * vocab_rows))


class ChunkedLogprobs(torch.autograd.Function):
    """log p(target) [N] and entropy [N] (no gradient: a metric) of logits hidden @ weight.T.

    `weight` holds vocabulary rows vocab_start .. vocab_start + weight.shape[0] of the whole
    vocabulary (all of it without tensor parallelism); rows at or past `valid_rows` are padding
    that takes no probability mass. Logits are computed in the inputs' dtype and upcast to fp32,
    as `(hidden @ weight.T).float()` would be.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int,
                vocab_start: int, valid_rows: int, group: dist.ProcessGroup | None, with_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        w = weight[:valid_rows]
        n = hidden.shape[0]
        local_lse = hidden.new_empty(n, dtype=torch.float32)
        target_logit = hidden.new_zeros(n, dtype=torch.float32)
        expected_logit = hidden.new_zeros(n, dtype=torch.float32)  # E_p[logit] over this rank's rows
        owned, local_target = _owned_targets(targets, vocab_start, valid_rows)
        if valid_rows == 0:  # a tensor-parallel rank holding only padding rows
            local_lse.fill_(float("-inf"))
        for start in range(0, n if valid_rows else 0, chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = (hidden[rows] @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            local_lse[rows] = lse
            target_logit[rows] = logits.gather(-1, local_target[rows, None]).squeeze(-1) * owned[rows]
            if with_entropy:
                probs = (logits - lse[:, None]).exp_()
                expected_logit[rows] = (probs[:, None, :] @ logits[:, :, None]).view(-1)
        lse, logprobs, entropy = _combine(local_lse, target_logit, expected_logit, group)
        ctx.save_for_backward(hidden, weight, local_target, owned, lse)
        ctx.chunk_rows, ctx.valid_rows = chunk_rows, valid_rows
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, _grad_entropy: torch.Tensor):
        hidden, weight, local_target, owned, lse = ctx.saved_tensors
        chunk_rows, valid_rows = ctx.chunk_rows, ctx.valid_rows
        w = weight[:valid_rows]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # Several chunks add into the weight gradient: accumulate in fp32, as one matmul would.
            several = hidden.shape[0] > chunk_rows and weight.dtype != torch.float32
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32 if several else weight.dtype,
                                      device=weight.device)
        if grad_hidden is not None and valid_rows == 0:
            grad_hidden.zero_()
        for start in range(0, hidden.shape[0] if valid_rows else 0, chunk_rows):
            rows = slice(start, start + chunk_rows)
            # d log p(target) / d logits = onehot(target) - softmax; scaled by the incoming gradient.
            grad_logits = (hidden[rows] @ w.t()).float().sub_(lse[rows, None]).exp_()
            grad_logits.mul_(-grad_logprobs[rows, None])
            grad_logits.scatter_add_(-1, local_target[rows, None], (grad_logprobs[rows] * owned[rows])[:, None])
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ w
            if grad_weight is not None:
                grad_weight[:valid_rows].add_(grad_logits.t() @ hidden[rows])
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _owned_targets(targets: torch.Tensor, vocab_start: int, valid_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which targets fall in this rank's vocabulary rows (float 0/1), and their local row (0 elsewhere)."""
    local = targets - vocab_start
    owned = (local >= 0) & (local < valid_rows)
    return owned.float(), torch.where(owned, local, torch.zeros_like(local))


def _combine(local_lse: torch.Tensor, target_logit: torch.Tensor, expected_logit: torch.Tensor,
             group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, log p(target), entropy) per row over the whole vocabulary, from each rank's share.

    lse = log sum_r exp(lse_r); the target logit lives on one rank (zeros elsewhere); the entropy
    H = lse - sum_v p_v l_v with sum_v p_v l_v = sum_r exp(lse_r - lse) * E_r[l].
    """
    if group is None or dist.get_world_size(group) == 1:
        return local_lse, target_logit - local_lse, local_lse - expected_logit
    top = local_lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    weight = (local_lse - top).exp()
    sums = torch.stack([weight, target_logit, weight * expected_logit])
    dist.all_reduce(sums, group=group)
    lse = top + sums[0].log()
    return lse, sums[1] - lse, lse - sums[2] / sums[0]


def gather_logprobs(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor,
                    chunk_rows: int | None = None, with_entropy: bool = False, *, vocab_start: int = 0,
                    valid_rows: int | None = None, group: dist.ProcessGroup | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) for each row of `hidden` [N, H] under logits hidden @ head_weight.T (fp32 math).

    Returns ([N] logprobs, [N] entropies or None). Differentiable in hidden and head_weight, with
    memory bounded by one chunk of logits in forward and backward (`ChunkedLogprobs`).
    `chunk_rows` defaults to `default_chunk_rows`. For a vocabulary split over the ranks of
    `group`, `head_weight` holds rows vocab_start.. of it, the first `valid_rows` of them real.
    """
    valid = head_weight.shape[0] if valid_rows is None else valid_rows
    rows = chunk_rows or default_chunk_rows(head_weight.shape[0])
    logprobs, entropy = ChunkedLogprobs.apply(hidden, head_weight, targets, rows, vocab_start, valid, group,
                                              with_entropy)
    return logprobs, (entropy if with_entropy else None)
