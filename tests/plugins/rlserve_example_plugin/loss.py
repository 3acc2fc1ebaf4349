"""GRPO's loss, counting the micro-batches it sees: the metric shows that a run trained with it."""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.algorithms.interfaces import LossInputs
from rlserve.algorithms.losses.grpo import GrpoLoss


class CountedGrpoLoss(GrpoLoss):
    # Summed over micro-batches and ranks, reported as is in the step's metrics.
    reported_sums = {"example_plugin/loss_micro_batches": "micro_batch_count"}

    def __call__(self, inputs: LossInputs, global_normalizer: Tensor | float) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = super().__call__(inputs, global_normalizer)
        return loss, {**metrics, "micro_batch_count": torch.ones((), device=loss.device)}
