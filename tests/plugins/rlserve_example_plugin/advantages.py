"""Advantages as each sample's reward minus its group's mean (GRPO's without the std), with a metric of its own."""

from __future__ import annotations

from torch import Tensor

from rlserve.algorithms.interfaces import AdvantageEstimator, AdvantageInputs
from rlserve.config.algorithms import AdvEstimatorCfg, LossFnCfg


class CenteredAdvantageEstimator(AdvantageEstimator):
    token_level = False

    def __init__(self, cfg: AdvEstimatorCfg, loss_cfg: LossFnCfg):
        self.needs_reference_logprobs = False

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        return inputs.rewards - inputs.rewards.mean(dim=1, keepdim=True)

    def metrics(self, inputs: AdvantageInputs) -> dict[str, float]:
        return {"example_plugin/estimator_groups": float(inputs.rewards.shape[0])}
