"""Supervised fine-tuning: the negative log-likelihood of the completion tokens.

Normalised by the step's valid tokens, so every token weighs the same however
the batch is split (the SFT warm start before GRPO).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.algorithms.interfaces import Loss, LossInputs
from rlserve.config.algorithms import LossFnCfg


class SftLoss(Loss):
    needs_generator_logprobs = False
    needs_prev_logprobs = False
    # One optimizer update per step, whatever policy.train_global_batch_size says (sft.batch_size sizes it).
    minibatched = False

    def __init__(self, cfg: LossFnCfg):
        self.needs_reference_logprobs = False
        self.token_level = True

    def __call__(self, inputs: LossInputs, global_normalizer: Tensor | float) -> tuple[Tensor, dict[str, Tensor]]:
        valid = inputs.mask > 0
        nll = -torch.where(valid, inputs.curr_logprobs, 0.0)
        loss = nll.sum() / global_normalizer
        metrics = {
            "loss_sum": loss.detach().float(),
            "nll_sum": nll.detach().float().sum(),
            "token_count": valid.float().sum(),
        }
        return loss, metrics
