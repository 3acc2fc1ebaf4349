"""GRPO's group-relative advantages: one group is the samples drawn for one prompt.

GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300) replaces PPO's value
network with the other samples of the same prompt: a sample's advantage is its
reward minus the group's mean, optionally divided by the group's std. RLOO
(Ahmadian et al. 2024, arXiv:2402.14740) leaves the sample itself out of its
baseline, which makes the baseline independent of the sample and the policy
gradient estimate unbiased.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.algorithms.interfaces import AdvantageEstimator, AdvantageInputs
from rlserve.config.algorithms import AdvEstimatorCfg, LossFnCfg

# Keeps the std normalisation finite for a group of nearly equal rewards.
STD_EPS = 1e-6


class GrpoAdvantageEstimator(AdvantageEstimator):
    """`grpo.adv_estimator: {name: grpo, normalize_rewards, use_leave_one_out_baseline}` (NeMo-RL's keys)."""

    token_level = False

    def __init__(self, cfg: AdvEstimatorCfg, loss_cfg: LossFnCfg):
        self.cfg = cfg
        self.needs_reference_logprobs = False

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        return group_advantages(inputs.rewards, self.cfg.normalize_rewards, self.cfg.use_leave_one_out_baseline)


def group_advantages(rewards: Tensor, normalize: bool, leave_one_out: bool) -> Tensor:
    """Advantages [num_groups, group_size] from rewards [num_groups, group_size].

    A = r - mean(group), or with `leave_one_out` A = r - mean(other samples of
    the group) = n / (n - 1) * (r - mean(group)). With `normalize`, A is divided
    by (std + STD_EPS) where std is the *unbiased* (Bessel, n - 1) std of the whole
    group, the estimator NeMo-RL's `calculate_baseline_and_std_per_prompt` uses.
    (For the leave-one-out baseline NeMo-RL divides by the std of the other
    samples instead; we divide by the group's std in both cases so that every
    sample of a group is scaled by the same number.)

    A group whose rewards are all equal gets A = 0 (never 0 / 0), and a group of
    one sample has no baseline to compare against, so it gets A = 0 too.
    """
    group_size = rewards.shape[1]
    if group_size == 1:
        return torch.zeros_like(rewards)
    if leave_one_out:
        baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
    else:
        baseline = rewards.mean(dim=1, keepdim=True)
    advantages = rewards - baseline
    if normalize:
        advantages = advantages / (rewards.std(dim=1, keepdim=True, correction=1) + STD_EPS)
    return advantages
