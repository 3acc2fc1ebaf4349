"""The "grpo" advantage estimator (REINFORCE++: test_reinforce_plus_plus.py), built by name as the coordinator builds it, against
hand-computed numbers and a float64 loop."""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.algorithms.interfaces import AdvantageInputs
from rlserve.algorithms.registry import advantage_estimator
from rlserve.config.spec import AdvEstimatorCfg, LossFnCfg


def rewards_only(rewards: torch.Tensor) -> AdvantageInputs:
    """What the grpo estimator reads: the rewards (one token per completion for the rest)."""
    shape = (*rewards.shape, 1)
    return AdvantageInputs(rewards, torch.ones(shape, dtype=torch.bool), torch.zeros(shape, dtype=rewards.dtype), None)


def estimate(rewards: torch.Tensor, normalize: bool, leave_one_out: bool) -> torch.Tensor:
    cfg = AdvEstimatorCfg(name="grpo", normalize_rewards=normalize, use_leave_one_out_baseline=leave_one_out)
    return advantage_estimator(cfg, LossFnCfg())(rewards_only(rewards))


def loop_advantages(rewards: list[list[float]], normalize: bool, leave_one_out: bool, eps: float) -> list[list[float]]:
    """Straightforward per-sample reference: mean of the group or of the others, Bessel std."""
    out = []
    for group in rewards:
        n = len(group)
        if n == 1:
            out.append([0.0])
            continue
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        row = []
        for i, r in enumerate(group):
            baseline = sum(group[j] for j in range(n) if j != i) / (n - 1) if leave_one_out else mean
            a = r - baseline
            row.append(a / (std + eps) if normalize else a)
        out.append(row)
    return out


def test_mean_baseline_without_normalisation():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(estimate(rewards, normalize=False, leave_one_out=False), expected)


def test_normalisation_uses_the_unbiased_std():
    # mean 0.5; unbiased std sqrt(4 * 0.25 / 3) = 0.57735 (the biased one, 0.5, would give +-1).
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    expected = torch.tensor([[a, -a, -a, a]], dtype=torch.float64)
    torch.testing.assert_close(estimate(rewards, normalize=True, leave_one_out=False), expected)


def test_leave_one_out_baseline():
    # Sample 0: 1 - mean(0, 0, 0) = 1; the others: 0 - mean(1, 0, 0) = -1/3.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    expected = torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]], dtype=torch.float64)
    torch.testing.assert_close(estimate(rewards, normalize=False, leave_one_out=True), expected)
    # Group std: mean 0.25, unbiased var (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5.
    torch.testing.assert_close(estimate(rewards, normalize=True, leave_one_out=True),
                               expected / (0.5 + 1e-6))


def test_group_of_two_leave_one_out():
    rewards = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    std = math.sqrt(0.5)
    expected = torch.tensor([[1.0, -1.0]], dtype=torch.float64) / (std + 1e-6)
    torch.testing.assert_close(estimate(rewards, normalize=True, leave_one_out=True), expected)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_group_of_one_and_equal_rewards_give_zero_not_nan(normalize, leave_one_out):
    single = estimate(torch.tensor([[0.7], [1.0]]), normalize, leave_one_out)
    torch.testing.assert_close(single, torch.zeros(2, 1))
    equal = estimate(torch.tensor([[3.0, 3.0, 3.0], [0.0, 0.0, 0.0]]), normalize, leave_one_out)
    torch.testing.assert_close(equal, torch.zeros(2, 3))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_matches_loop_reference(normalize, leave_one_out):
    rewards = torch.rand(5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rewards[1] = 0.25
    expected = loop_advantages(rewards.tolist(), normalize, leave_one_out, eps=1e-6)
    got = estimate(rewards, normalize, leave_one_out)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))


def test_defaults_normalise_with_the_group_mean_baseline():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(advantage_estimator(AdvEstimatorCfg(), LossFnCfg())(rewards_only(rewards)),
                               estimate(rewards, True, False))
