"""REINFORCE++: per-token returns with the KL penalty in the reward, normalised over the whole batch.

REINFORCE++ (Hu et al. 2025, arXiv:2501.03262) trains without a critic and
without group-relative scaling. Each token's reward is the sequence's score at
its last token minus the KL penalty at every token,

    r_t = 1[t = T] R  -  beta * KL_t,        KL_t = KL(pi_old || pi_ref) at token t,

its advantage the return to the end (gamma = 1),

    A_t = R - beta * sum_{s >= t} KL_s,

and the advantages are normalised over every valid token of the global batch,
A <- (A - mean) / std, which the paper finds more stable than per-group
normalisation. REINFORCE++-baseline (the paper's later version, NeMo-RL's
`minus_baseline`) first subtracts the group's mean score from R. pi_old is
the generator that sampled the tokens (its recorded logprobs); the KL
estimator is `loss_fn.reference_policy_kl_type` (the paper's is k1), clamped
as the loss's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.algorithms.interfaces import AdvantageEstimator, AdvantageInputs
from rlserve.algorithms.losses.components import reference_kl
from rlserve.config.algorithms import AdvEstimatorCfg, LossFnCfg

# Floor of the batch variance the normalisation divides by (NeMo-RL's and OpenRLHF's).
VAR_EPS = 1e-8


class ReinforcePlusPlusAdvantageEstimator(AdvantageEstimator):
    """`grpo.adv_estimator: {name: reinforce_plus_plus, minus_baseline}` with `loss_fn.use_kl_in_reward`,
    `reference_policy_kl_penalty` (beta) and `reference_policy_kl_type` (NeMo-RL's keys)."""

    token_level = True
    # Normalised over the batch, a group whose samples tie still has advantages (0.5 at the defaults),
    # and dropping it would move the other groups' (by up to 1.8 in a measured batch): it trains.
    group_relative = False

    def __init__(self, cfg: AdvEstimatorCfg, loss_cfg: LossFnCfg):
        self.cfg, self.loss_cfg = cfg, loss_cfg
        self.beta = loss_cfg.reference_policy_kl_penalty if loss_cfg.use_kl_in_reward else 0.0
        self.needs_reference_logprobs = self.beta > 0

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        kl = None
        if self.beta > 0:
            if inputs.ref_logprobs is None:
                raise ValueError("loss_fn.use_kl_in_reward needs the reference policy's logprobs")
            kl = reference_kl(inputs.gen_logprobs, inputs.ref_logprobs, self.loss_cfg.reference_policy_kl_type,
                              self.loss_cfg.kl_input_clamp_value, self.loss_cfg.kl_output_clamp_value)
        return reinforce_plus_plus_advantages(inputs.rewards, inputs.mask, kl, self.beta, self.cfg.minus_baseline)


def reinforce_plus_plus_advantages(rewards: Tensor, mask: Tensor, kl: Tensor | None, beta: float,
                                   minus_baseline: bool) -> Tensor:
    """Advantages [G, n, T] from scores [G, n], the completion mask [G, n, T] and per-token KL [G, n, T]."""
    valid = mask.to(rewards.dtype)
    score = rewards - rewards.mean(dim=1, keepdim=True) if minus_baseline else rewards
    returns = score[..., None] * valid
    if kl is not None:
        # sum_{s >= t} KL_s: a reverse cumulative sum over each completion's valid tokens.
        kl = kl * valid
        returns = returns - beta * (kl.sum(dim=-1, keepdim=True) - kl.cumsum(dim=-1) + kl)
    count = valid.sum().clamp(min=1)
    mean = (returns * valid).sum() / count
    var = ((returns - mean).square() * valid).sum() / count
    return (returns - mean) * torch.rsqrt(var.clamp(min=VAR_EPS)) * valid
