"""CISPO: GRPO's loss with a clipped, detached importance weight in place of PPO's clipped update.

MiniMax-M1 (MiniMax 2025, arXiv:2506.13585, eq. 4), per token with
r = pi_curr / pi_prev:

    loss_t = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_curr  [* w]  +  beta * KL_t

averaged over the step's tokens. Every other piece (the generator importance
weight w, its truncation, the KL term, the metrics) is GRPO's (`grpo.py`), as
in NeMo-RL, where `loss_fn.use_cispo` switches the same shared loss. The paper
sets no lower bound on the weight (ratio_clip_min 1) and tunes only the upper;
the spec refuses the dual clip, sequence-level ratios and sequence-level
aggregation with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.algorithms.losses.components import cispo_surrogate
from rlserve.algorithms.losses.grpo import GrpoLoss


class CispoLoss(GrpoLoss):
    def surrogate(self, ratio: Tensor, adv: Tensor, curr: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        loss, clipped = cispo_surrogate(ratio, adv, curr, self.cfg.ratio_clip_min, self.cfg.ratio_clip_max)
        return loss, clipped, torch.zeros_like(clipped)
