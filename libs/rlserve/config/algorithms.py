"""The spec sections that choose and tune the algorithm: advantages, the loss, reward shaping, SFT, DPO.

Names come from the catalog (`rlserve.catalog`: the built-ins and the cluster's enabled plug-ins),
which imports no torch, so a spec validates without it. Keys are NeMo-RL's where it has them (else
verl's).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlserve.catalog import ADVANTAGE_ESTIMATORS, LOSSES, SUPERVISED_LOSSES
from rlserve.config.section import MAX_SEQUENCE_LENGTH, MAX_STEPS, MAX_TRAJECTORIES_PER_STEP, Section

# The consistency metrics (`rlserve.algorithms.mismatch`) a guard may watch: `mismatch/<name>`, or one age or
# turn bucket's, `mismatch/age_0/<name>`.
MISMATCH_METRICS = ("token_mult_prob_error", "gen_kl_k3", "logprob_abs_diff_mean", "logprob_abs_diff_max",
                    "is_truncated_fraction")
MISMATCH_SCOPE = re.compile(r"^((age_[0-2]|age_3_plus|turn_[1-3]|turn_4_plus)/)?(\w+)$")

# The keys of grpo.adv_estimator each estimator reads (another estimator's, set off its default, is refused).
ESTIMATOR_KEYS = {"grpo": ("normalize_rewards", "use_leave_one_out_baseline"),
                  "reinforce_plus_plus": ("minus_baseline",),
                  "on_policy_distillation": ("teacher_kl_coef", "task_reward_weight")}


class AdvEstimatorCfg(Section):
    """How rewards become advantages (`rlserve.algorithms.advantages`); NeMo-RL's AdvEstimatorConfig."""

    # grpo, reinforce_plus_plus, on_policy_distillation, or an enabled plug-in's (`rlserve.catalog`).
    name: str = "grpo"
    # grpo: divide by the group's reward std.
    normalize_rewards: bool = True
    # grpo: RLOO's baseline, the mean of the group's other samples.
    use_leave_one_out_baseline: bool = False
    # reinforce_plus_plus: subtract the group's mean reward before the batch normalisation
    # (REINFORCE++-baseline); false: the raw reward (REINFORCE++ as first published).
    minus_baseline: bool = True
    # on_policy_distillation (with teacher.model_name): each token's advantage is teacher_kl_coef x
    # (teacher logprob - student logprob), plus task_reward_weight x the sample's GRPO advantage.
    teacher_kl_coef: float = Field(1.0, gt=0, le=100)
    task_reward_weight: float = Field(0.0, ge=0, le=100)

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return ADVANTAGE_ESTIMATORS.check(v)

    @model_validator(mode="after")
    def _keys_of_this_estimator(self) -> AdvEstimatorCfg:
        for name, keys in ESTIMATOR_KEYS.items():
            for key in keys:
                if name != self.name and getattr(self, key) != type(self).model_fields[key].default:
                    raise ValueError(f"grpo.adv_estimator.{key}: only read by the {name} estimator "
                                     f"(grpo.adv_estimator.name is {self.name!r})")
        return self


class MismatchGuardCfg(Section):
    """What a run does when the generator's logprobs drift from the learner's (`rlserve.loop.consistency`):
    after every step, `mismatch/<metric>` above `max` emits a WARNING event naming the step, the metric,
    its value and the likely causes, then `warn` goes on, `pause` saves a checkpoint and stops the run
    PAUSED (`rlserve submit --resume` continues it), `fail` fails it.

    The default, NeMo-RL's nightly bound on token_mult_prob_error (its recipes fail at a median of 1.1),
    is far above a healthy run's: 1.0000002 between fp32 engines and the learner on CPU, 1.017 between
    bf16 vLLM and the bf16 learner of the 1b preset on an H200 (BENCHMARKS.md), while weights that are
    not the learner's (one transfer with noise on every tensor) measured 1.2 from the first step that
    sampled them (docs/algorithms.md, "Consistency")."""

    # Off: the metrics are still measured and reported, nothing is checked.
    enabled: bool = True
    # A name of MISMATCH_METRICS, optionally scoped to an age or turn bucket ("age_0/logprob_abs_diff_max":
    # the tokens of the newest weights only, which leaves an async run's staleness out).
    metric: str = "token_mult_prob_error"
    # The bound: a step whose metric is above it crosses.
    max: float = Field(1.1, gt=0, le=1e6)
    # What a crossing does after its WARNING event: go on, pause the run resumably after a checkpoint
    # at the step (needs checkpointing.enabled), or fail it.
    action: Literal["warn", "pause", "fail"] = "warn"

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        match = MISMATCH_SCOPE.match(v)
        if match is None or match.group(3) not in MISMATCH_METRICS:
            raise ValueError(f"unknown consistency metric {v!r}; valid: {', '.join(MISMATCH_METRICS)}, each "
                             f"optionally after age_0/ .. age_2/, age_3_plus/, turn_1/ .. turn_3/ or turn_4_plus/")
        return v


class LossFnCfg(Section):
    # The loss of the GRPO steps: grpo, cispo, or an enabled plug-in's (`rlserve.catalog`); the SFT warm
    # start always uses "sft".
    name: str = "grpo"
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    # The KL penalty goes into each token's reward (REINFORCE++; the reinforce_plus_plus estimator
    # reads it) instead of into the loss.
    use_kl_in_reward: bool = False
    kl_input_clamp_value: float | None = Field(20.0, gt=0)
    kl_output_clamp_value: float | None = Field(10.0, gt=0)
    # The clip range [1 - ratio_clip_min, 1 + ratio_clip_max] of the PPO ratio (grpo) or of the
    # importance weight (cispo, where MiniMax-M1 sets no lower bound: ratio_clip_min 1).
    ratio_clip_min: float = Field(0.2, ge=0, le=1)
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
    # The generator-vs-learner consistency guard, checked after every step of an RL run.
    mismatch_guard: MismatchGuardCfg = MismatchGuardCfg()

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return LOSSES.check(v, [n for n in LOSSES.names if n not in SUPERVISED_LOSSES])

    @model_validator(mode="before")
    @classmethod
    def _use_cispo(cls, data: Any) -> Any:
        """NeMo-RL's `loss_fn.use_cispo: true` is `loss_fn.name: cispo` here (written back in that form)."""
        if not isinstance(data, dict) or "use_cispo" not in data:
            return data
        rest = {k: v for k, v in data.items() if k != "use_cispo"}
        if data["use_cispo"] is True:
            if rest.get("name", "cispo") != "cispo":
                raise ValueError(f"use_cispo: true, but loss_fn.name is {rest['name']!r}; keep one of them")
            return {**rest, "name": "cispo"}
        if data["use_cispo"] is False:
            return rest
        raise ValueError(f"use_cispo: true or false, not {data['use_cispo']!r}")

    @model_validator(mode="after")
    def _consistent(self) -> LossFnCfg:
        if self.name == "cispo":
            # CISPO is a token-level objective on a clipped, detached weight (NeMo-RL refuses the same).
            if self.ratio_clip_c is not None:
                raise ValueError("loss_fn.ratio_clip_c: the dual clip does not apply to the cispo loss")
            if self.sequence_level_importance_ratios:
                raise ValueError("loss_fn.sequence_level_importance_ratios: the cispo loss weighs each token")
            if not self.token_level_loss:
                raise ValueError("loss_fn.token_level_loss: the cispo loss is token-level")
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

    def warnings(self) -> list[str]:
        """What a valid section still gets wrong, for the run's WARNING events."""
        fields = type(self).model_fields
        if self.name == "cispo" and all(getattr(self, k) == fields[k].default
                                        for k in ("ratio_clip_min", "ratio_clip_max")):
            return ["loss_fn.name: cispo with PPO's clip range (ratio_clip_min and ratio_clip_max at 0.2): this is not "
                    "the paper's CISPO, which sets no lower bound on the weight and a wide upper one (MiniMax-M1: "
                    "ratio_clip_min: 1.0; examples/grpo_addition_cispo.yaml uses ratio_clip_max: 5.0)"]
        return []


class RewardShapingCfg(Section):
    """DAPO's overlong reward shaping (Yu et al. 2025, arXiv:2503.14476, section 3.4): a completion
    longer than max_response_length - overlong_buffer_length tokens loses reward linearly, up to
    overlong_buffer_penalty at max_response_length (`rlserve.algorithms.reward_shaping`). NeMo-RL's
    `grpo.reward_shaping` keys (verl: `reward_model.overlong_buffer.{len, penalty_factor}`)."""

    enabled: bool = False
    overlong_buffer_length: int | None = Field(None, ge=1, le=MAX_SEQUENCE_LENGTH)
    overlong_buffer_penalty: float = Field(1.0, ge=0, le=1e6)
    # None: policy.generation.max_new_tokens (the cap generation stops at).
    max_response_length: int | None = Field(None, ge=1, le=MAX_SEQUENCE_LENGTH)

    @model_validator(mode="after")
    def _buffer_given(self) -> RewardShapingCfg:
        if self.enabled and self.overlong_buffer_length is None:
            raise ValueError("overlong_buffer_length: required when reward shaping is enabled")
        return self


class SftCfg(Section):
    """Supervised training on the data's reference answers (assistant turns): the warm start before GRPO
    (`enabled`), or an `algorithm: sft` run (then `enabled` stays false). One update per step at `lr`: constant
    in the warm start; in an `algorithm: sft` run shaped by `policy.scheduler` (warm-up, cosine decay over
    sft.max_num_steps)."""

    enabled: bool = False
    max_num_steps: int = Field(300, ge=1, le=MAX_STEPS)
    batch_size: int = Field(64, ge=1, le=MAX_TRAJECTORIES_PER_STEP)
    lr: float = Field(1e-3, gt=0, le=1.0)
    val_period: int = Field(25, ge=1, le=MAX_STEPS)
    # Stop early once the held-out reward reaches this (None: run all steps).
    stop_at_val_reward: float | None = Field(0.25, ge=0)


class DpoCfg(Section):
    """An `algorithm: dpo` run (Rafailov et al. 2023, `rlserve.algorithms.losses.dpo`) on a preference file;
    NeMo-RL's `dpo` keys. One update per step at `lr`, shaped by `policy.scheduler` (warm-up, cosine decay
    over dpo.max_num_steps)."""

    max_num_steps: int = Field(100, ge=1, le=MAX_STEPS)
    # Preference pairs per step (two sequences each; NeMo-RL: policy.train_global_batch_size).
    batch_size: int = Field(32, ge=1, le=MAX_TRAJECTORIES_PER_STEP // 2)
    lr: float = Field(1e-5, gt=0, le=1.0)
    # DPO's beta: how far the policy may move from the reference for a given preference.
    reference_policy_kl_penalty: float = Field(0.05, gt=0, le=1000)
    preference_loss_weight: float = Field(1.0, ge=0, le=1000)
    # An NLL term on the chosen response (0: plain DPO).
    sft_loss_weight: float = Field(0.0, ge=0, le=1000)
    # Per-token means of the responses' logprobs instead of sums.
    preference_average_log_probs: bool = False
    sft_average_log_probs: bool = False

    @model_validator(mode="after")
    def _some_loss(self) -> DpoCfg:
        if self.preference_loss_weight == 0 and self.sft_loss_weight == 0:
            raise ValueError("preference_loss_weight: 0, and sft_loss_weight is 0 too: the loss would be 0")
        return self
