"""Groups without reward variance (DAPO's dynamic sampling drops them)."""

from __future__ import annotations

import torch

from rlserve.algorithms.dynamic_sampling import zero_variance_groups


def test_zero_variance_groups():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.5, 0.5, 0.5], [0.0, 0.0, 1e-3]])
    assert zero_variance_groups(rewards).tolist() == [True, False, True, False]
    assert zero_variance_groups(torch.tensor([[0.3], [2.0]])).tolist() == [True, True]
