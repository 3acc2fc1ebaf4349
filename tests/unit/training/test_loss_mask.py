"""Multi-turn trajectories: only the policy's own tokens train. The environment's observations and the
chat template's turn markers (loss mask 0) get zero gradient, count in no normaliser and no metric, and
the same holds packed, padded and across micro-batches and minibatches."""

from __future__ import annotations

import pytest
import torch

from rlserve.config import parse_spec
from rlserve.training.batch import TrainBatch
from rlserve.training.objective import StepObjective

# Prompt of 2, then: assistant (3) | observation (2) | assistant (2)  and  assistant (2) | obs (3) | assistant (1).
TOKENS = [[1, 2, 10, 11, 12, 50, 51, 13, 14], [1, 2, 20, 21, 60, 61, 62, 22], [1, 2, 30, 31]]
PROMPTS = [2, 2, 2]
MASKS = [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 1], [1, 1]]


def make_batch(masks=MASKS) -> TrainBatch:
    gen = [[-0.7 if m else 0.0 for m in row] for row in masks]
    return TrainBatch.from_sequences(TOKENS, PROMPTS, [1.0, -0.5, 0.25], gen, None, loss_mask=masks)


def step_loss(batch: TrainBatch, curr_of, *, packed: bool, gbs: int, mbs: int, **loss_fn):
    spec = parse_spec({"policy": {"train_global_batch_size": gbs, "train_micro_batch_size": mbs,
                                  "sequence_packing": {"enabled": packed, "train_mb_tokens": 128}},
                       "loss_fn": {"use_importance_sampling_correction": True, **loss_fn}})
    obj = StepObjective(spec, batch, "grpo", dp_size=1, dp_rank=0, pad_id=0)
    total = 0.0
    for k, plan in enumerate(obj.plans):
        for mb in plan:
            total = total + obj.micro_batch_loss(k, mb, curr_of(mb), None)
    return total, obj


def per_token_logprobs(batch: TrainBatch) -> torch.Tensor:
    """One leaf per completion token (flat, batch order), so each token's gradient can be read."""
    n = int(batch.completion_lens.sum())
    return torch.linspace(-1.2, -0.3, n).requires_grad_()


def curr_from(leaf: torch.Tensor, batch: TrainBatch):
    """The micro-batch's tokens taken from the flat leaf, in the micro-batch's order."""
    starts = (torch.cumsum(batch.completion_lens, 0) - batch.completion_lens).tolist()

    def of(mb):
        # Rebuild which sequences this micro-batch holds from its targets (sequences are distinct).
        rows = []
        for i, (s, n) in enumerate(zip(starts, batch.completion_lens.tolist())):
            seq = batch.sequence(i)[PROMPTS[i]:]
            rows.append((seq.tolist(), s, n))
        out, pos, targets = [], 0, mb.targets.tolist()
        while pos < len(targets):
            for seq, s, n in rows:
                if targets[pos:pos + n] == seq:
                    out.append(leaf[s:s + n])
                    pos += n
                    break
            else:
                raise AssertionError("micro-batch tokens not found")
        return torch.cat(out)
    return of


@pytest.mark.parametrize("packed,gbs,mbs", [(False, 3, 3), (True, 3, 3), (False, 3, 1), (True, 2, 1)])
def test_environment_tokens_get_zero_gradient(packed, gbs, mbs):
    batch = make_batch()
    leaf = per_token_logprobs(batch)
    loss, obj = step_loss(batch, curr_from(leaf, batch), packed=packed, gbs=gbs, mbs=mbs)
    loss.backward()
    mask = torch.tensor([m for row in MASKS for m in row], dtype=torch.bool)
    assert torch.all(leaf.grad[~mask] == 0)
    assert torch.all(leaf.grad[mask] != 0)
    assert sum(obj.normalizers) == int(mask.sum())  # token-level normaliser counts trained tokens only


def test_the_masked_loss_is_the_loss_of_the_policys_tokens_alone():
    """Changing what the environment's tokens carry (their logprobs, the generator's) changes nothing."""
    batch = make_batch()
    leaf = per_token_logprobs(batch)
    a, _ = step_loss(batch, curr_from(leaf, batch), packed=True, gbs=3, mbs=3)
    mask = torch.tensor([m for row in MASKS for m in row], dtype=torch.bool)
    other = make_batch()
    other.gen_logprobs = torch.where(mask, other.gen_logprobs, torch.full_like(other.gen_logprobs, -30.0))
    noisy = torch.where(mask, leaf.detach(), torch.full_like(leaf, -50.0))
    b, _ = step_loss(other, curr_from(noisy, other), packed=True, gbs=3, mbs=3)
    assert a.item() == pytest.approx(b.item(), abs=1e-7)


def test_metrics_count_only_trained_tokens():
    batch = make_batch()
    leaf = per_token_logprobs(batch)
    spec = parse_spec({"loss_fn": {"use_importance_sampling_correction": True}})
    obj = StepObjective(spec, batch, "grpo", dp_size=1, dp_rank=0, pad_id=0)
    curr = curr_from(leaf, batch)
    for k, plan in enumerate(obj.plans):
        for mb in plan:
            obj.micro_batch_loss(k, mb, curr(mb), None, entropy=torch.ones(mb.targets.numel()))
    metrics = obj.finalize(None)
    assert metrics["batch/valid_tokens"] == 10.0
    assert metrics["policy/entropy"] == pytest.approx(1.0)


def test_a_mask_must_cover_the_completion_and_train_something():
    with pytest.raises(ValueError, match=r"sequences\[0\].loss_mask: 2 values for 7 completion tokens"):
        TrainBatch.from_sequences(TOKENS, PROMPTS, [0.0] * 3, None, None, loss_mask=[[1, 1], [1] * 6, [1, 1]])
    with pytest.raises(ValueError, match=r"sequences\[2\].loss_mask: no completion token is trained"):
        TrainBatch.from_sequences(TOKENS, PROMPTS, [0.0] * 3, None, None, loss_mask=[[1] * 7, [1] * 6, [0, 0]])
