"""A step's reward metrics: the rewards' spread, and each number the reward functions reported per sample,
averaged over the samples that report it."""

from __future__ import annotations

import pytest
import torch

from rlserve.trajectories.metrics import reward_metrics
from rlserve.trajectories.trajectory import Group, Trajectory


def group(rewards: list[float], reported: list[dict[str, float]]) -> Group:
    reported = reported + [{}] * (len(rewards) - len(reported))
    return Group(prompt_index=0, prompt_ids=[1], weight_version=0, trajectories=[
        Trajectory(tokens=[2], logprobs=[0.0], mask=[True], reward=r, reward_metrics=m)
        for r, m in zip(rewards, reported)])


def test_reported_numbers_are_averaged_over_the_samples_that_report_them():
    groups = [group([1.0, 0.0], [{"llm_judge/unparsed": 1.0}, {"llm_judge/unparsed": 0.0, "rm/len": 4.0}]),
              group([0.5, 0.5], [{"llm_judge/unparsed": 1.0}, {}])]
    out = reward_metrics(torch.tensor([g.rewards for g in groups]), groups)
    assert out["reward/mean"] == pytest.approx(0.5) and out["reward/max"] == 1.0
    assert out["reward/llm_judge/unparsed"] == pytest.approx(2 / 3) and out["reward/rm/len"] == 4.0
    assert set(reward_metrics(torch.tensor([[1.0, 0.0]]), [group([1.0, 0.0], [])])) == \
        {"reward/mean", "reward/std", "reward/max"}
