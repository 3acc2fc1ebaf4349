"""The step's plan follows what the loss declares, never the loss's name."""

from __future__ import annotations

import pytest
import torch

from rlserve.config import parse_spec
from rlserve.training.batch import TrainBatch
from rlserve.training.objective import StepObjective

# Four sequences with 2, 3, 1 and 2 completion tokens.
TOKENS = [[1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3], [1, 2, 3, 4]]
PROMPTS = [2, 2, 2, 2]


def batch(with_generator_logprobs: bool) -> TrainBatch:
    gen = [[-0.5] * (len(t) - p) for t, p in zip(TOKENS, PROMPTS)] if with_generator_logprobs else None
    return TrainBatch.from_sequences(TOKENS, PROMPTS, [1.0, -1.0, 0.5, 0.0], gen)


def objective(loss_name: str, loss_fn: dict | None = None, with_generator_logprobs: bool = True) -> StepObjective:
    spec = parse_spec({"policy": {"train_global_batch_size": 2}, "loss_fn": loss_fn or {}})
    return StepObjective(spec, batch(with_generator_logprobs), loss_name, dp_size=1, dp_rank=0, pad_id=0)


def test_grpo_is_minibatched_and_needs_the_starting_policy():
    grpo = objective("grpo")
    assert len(grpo.plans) == 2 and grpo.needs_prev_logprobs
    assert grpo.normalizers == [5.0, 3.0]  # valid tokens of each update
    # The first update trains at the starting weights: only the later ones need a forward pass for them.
    forwarded = []
    prev = grpo.prev_logprobs(lambda plan: forwarded.append(plan) or [torch.zeros(1) for _ in plan])
    assert len(forwarded) == 1 and forwarded[0] is grpo.plans[1]
    assert prev[0] == [None] * len(grpo.plans[0]) and len(prev[1]) == len(grpo.plans[1])
    assert objective("grpo", {"token_level_loss": False}).normalizers == [2.0, 2.0]  # sequences


def test_sft_is_one_update_over_tokens_without_generator_logprobs():
    sft = objective("sft", {"token_level_loss": False}, with_generator_logprobs=False)
    assert len(sft.plans) == 1 and not sft.needs_prev_logprobs
    assert sft.normalizers == [8.0]


def test_a_loss_that_needs_generator_logprobs_refuses_a_batch_without_them():
    with pytest.raises(ValueError, match="the grpo loss needs the generator's logprobs"):
        objective("grpo", with_generator_logprobs=False)


def test_unknown_loss_names_fail_listing_the_valid_ones():
    with pytest.raises(ValueError, match="unknown loss 'ppo'; valid: grpo, cispo, sft"):
        objective("ppo")


def test_a_loss_mask_leaves_tokens_out_of_the_loss_and_the_normaliser():
    """SFT on a conversation: the masked tokens (a user turn between assistant turns) neither count nor weigh."""
    masks = [[True, False], [True, True, False], [True], [False, True]]
    masked = TrainBatch.from_sequences(TOKENS, PROMPTS, loss_mask=masks)
    sft = StepObjective(parse_spec({}), masked, "sft", dp_size=1, dp_rank=0, pad_id=0)
    assert sft.normalizers == [5.0]
    (mb,) = sft.plans[0]
    curr = torch.tensor([-1.0, -9.0, -2.0, -3.0, -9.0, -4.0, -9.0, -5.0], requires_grad=True)
    loss = sft.micro_batch_loss(0, mb, curr, None)
    loss.backward()
    assert loss.item() == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)
    assert curr.grad.tolist() == pytest.approx([-0.2, 0, -0.2, -0.2, 0, -0.2, 0, -0.2])
