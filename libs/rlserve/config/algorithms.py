"""The spec sections that choose and tune the algorithm: advantages, the loss, reward shaping.

Names come from the registries (`rlserve.algorithms.registry`), which import no torch, so a
spec validates without it. Keys are NeMo-RL's where it has them (else verl's).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlserve.algorithms.registry import ADVANTAGE_ESTIMATORS, LOSSES, SUPERVISED_LOSSES
from rlserve.config.section import Section


class AdvEstimatorCfg(Section):
    """How rewards become advantages (`rlserve.algorithms.advantages`); NeMo-RL's AdvEstimatorConfig."""

    name: Literal[ADVANTAGE_ESTIMATORS.names] = "grpo"
    # Divide by the group's reward std.
    normalize_rewards: bool = True
    # RLOO's baseline: the mean of the group's other samples.
    use_leave_one_out_baseline: bool = False


class LossFnCfg(Section):
    # The loss of the GRPO steps (`rlserve.algorithms.registry`); the SFT warm start always uses "sft".
    name: Literal[tuple(n for n in LOSSES.names if n not in SUPERVISED_LOSSES)] = "grpo"
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: float | None = Field(20.0, gt=0)
    kl_output_clamp_value: float | None = Field(10.0, gt=0)
    ratio_clip_min: float = Field(0.2, ge=0, lt=1)
    ratio_clip_max: float = Field(0.2, ge=0, le=100)
    # Dual-clip constant c > 1 (Ye et al. 2020); None disables it.
    ratio_clip_c: float | None = Field(None, gt=1)
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    # Truncation of the generator->learner importance weight; None: no truncation.
    truncated_importance_sampling_ratio: float | None = Field(2.0, gt=0)
    truncated_importance_sampling_type: Literal["tis", "icepop"] = "tis"
    # icepop masks tokens whose weight leaves [ratio_min, ratio]; ratio_min None means 1/ratio.
    truncated_importance_sampling_ratio_min: float | None = Field(None, gt=0)
    # GSPO (Zheng et al. 2025): one ratio and one importance weight per sequence (geometric mean
    # over its tokens), for both the PPO ratio and the generator correction.
    sequence_level_importance_ratios: bool = False
    token_level_loss: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> LossFnCfg:
        if self.sequence_level_importance_ratios and self.token_level_loss:
            raise ValueError("loss_fn.sequence_level_importance_ratios: sequence-level ratios need "
                             "loss_fn.token_level_loss: false (as in NeMo-RL)")
        lo, hi = self.truncated_importance_sampling_ratio_min, self.truncated_importance_sampling_ratio
        if lo is not None:
            if self.truncated_importance_sampling_type != "icepop":
                raise ValueError("loss_fn.truncated_importance_sampling_ratio_min: only used by the icepop type")
            if hi is not None and lo > hi:
                raise ValueError(f"loss_fn.truncated_importance_sampling_ratio_min: {lo} is above "
                                 f"truncated_importance_sampling_ratio {hi}")
        return self
