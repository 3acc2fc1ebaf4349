"""Per-token logprobs of completion tokens, computed from hidden states in row chunks.

Only the positions that predict a completion token are projected onto the
vocabulary, a chunk of rows at a time. Without grad (reference scoring, the
step's old logprobs) the temporary fp32 logits stay within a fixed budget
(about 1 GiB) whatever the batch and sequence length; with grad, autograd
keeps every chunk's logits for the backward pass, so memory grows with the
number of completion tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def completion_positions(completion_mask: torch.Tensor) -> torch.Tensor:
    """Mask over hidden-state positions [B, L]: position t predicts token t+1, so shift by one."""
    select = torch.zeros_like(completion_mask, dtype=torch.bool)
    select[:, :-1] = completion_mask[:, 1:].bool()
    return select


LOGITS_BUDGET_BYTES = 2**30


def gather_logprobs(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor,
                    chunk_rows: int | None = None, with_entropy: bool = False,
                    logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) for each row of `hidden` [N, H] under logits hidden @ head_weight.T (fp32 math).

    `logits_fn` is the model's own post-processing of those logits (soft-capping, scaling:
    `rlserve.models.architecture.OutputLogits`), applied in fp32 before the softmax.

    Returns ([N] logprobs, [N] entropies or None). Differentiable in hidden and head_weight.
    `chunk_rows` defaults to the most rows whose fp32 logits fit LOGITS_BUDGET_BYTES: few, large
    matmuls for big vocabularies, one for small ones.
    """
    chunk_rows = chunk_rows or max(256, LOGITS_BUDGET_BYTES // (4 * head_weight.shape[0]))
    out, ents = [], []
    # At least one (possibly empty) chunk, so that the result stays connected to the graph: a
    # micro-batch without completion tokens must still run backward (FSDP's collectives).
    for start in range(0, max(1, hidden.shape[0]), chunk_rows):
        logits = (hidden[start:start + chunk_rows] @ head_weight.t()).float()
        if logits_fn is not None:
            logits = logits_fn(logits)
        lse = torch.logsumexp(logits, dim=-1)
        out.append(logits.gather(-1, targets[start:start + chunk_rows, None]).squeeze(-1) - lse)
        if with_entropy:
            with torch.no_grad():
                probs = torch.softmax(logits, dim=-1)
                ents.append(lse - (probs * logits).sum(-1))
    return torch.cat(out), (torch.cat(ents) if with_entropy else None)
