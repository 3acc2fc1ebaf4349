"""Which groups carry no learning signal (DAPO's dynamic sampling).

DAPO (Yu et al. 2025, arXiv:2503.14476) drops the groups whose samples all got
the same reward: their group-relative advantages are all zero, so they add no
policy-gradient signal (only KL and normaliser weight).
"""

from __future__ import annotations

from torch import Tensor


def zero_variance_groups(rewards: Tensor) -> Tensor:
    """Bool [num_groups]: groups whose rewards [num_groups, group_size] are all exactly equal.

    The coordinator may drop them (`grpo.skip_zero_advantage_groups`). A group of one is trivially equal.
    """
    return (rewards == rewards[:, :1]).all(dim=1)
