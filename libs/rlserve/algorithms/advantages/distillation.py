"""On-policy distillation: a teacher's per-token logprobs on the student's own samples are the signal.

The student samples; a teacher (a model with the student's tokenizer, scored by
the reference service) gives the logprob of every sampled token; each token's
advantage is the negative sampled reverse KL,

    A_t = coef * clamp(log pi_T(y_t) - log pi_S(y_t)),

a one-sample estimate of -KL(pi_S || pi_T) at that token on the student's own
distribution (GKD, Agarwal et al. 2024, arXiv:2306.13649, with on-policy
samples; the per-token reward of Thinking Machines' "On-Policy Distillation",
2025). The policy-gradient loss with these advantages lowers the student's
reverse KL to the teacher: mode-seeking, on the states the student visits.
With `task_reward_weight` w > 0 a task reward is mixed in, A_t += w * A_GRPO
(the group-normalised advantage of the sample's reward). pi_S is the
generator that sampled the tokens (its recorded logprobs). The log-ratio is
clamped to +-`loss_fn.kl_input_clamp_value`, so a token the teacher finds
impossible cannot dominate the step.
"""

from __future__ import annotations

from torch import Tensor

from rlserve.algorithms.advantages.grpo import group_advantages
from rlserve.algorithms.interfaces import AdvantageEstimator, AdvantageInputs
from rlserve.config.algorithms import AdvEstimatorCfg, LossFnCfg


class OnPolicyDistillationAdvantageEstimator(AdvantageEstimator):
    """`grpo.adv_estimator: {name: on_policy_distillation, teacher_kl_coef, task_reward_weight}` with
    `teacher.model_name`."""

    token_level = True
    group_relative = False  # samples that scored alike still carry the teacher's signal

    def __init__(self, cfg: AdvEstimatorCfg, loss_cfg: LossFnCfg):
        self.cfg, self.clamp = cfg, loss_cfg.kl_input_clamp_value
        self.needs_reference_logprobs = True

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        if inputs.ref_logprobs is None:
            raise ValueError("on-policy distillation needs the teacher's logprobs (teacher.model_name)")
        return distillation_advantages(inputs.rewards, inputs.mask, inputs.gen_logprobs, inputs.ref_logprobs,
                                       self.cfg.teacher_kl_coef, self.cfg.task_reward_weight, self.clamp)

    def metrics(self, inputs: AdvantageInputs) -> dict[str, float]:
        """The student's reverse KL to the teacher per token (k1, on its samples): what distillation lowers."""
        if inputs.ref_logprobs is None or not inputs.mask.any():
            return {}
        return {"distillation/reverse_kl": (inputs.gen_logprobs - inputs.ref_logprobs)[inputs.mask].mean().item()}


def distillation_advantages(rewards: Tensor, mask: Tensor, student: Tensor, teacher: Tensor, coef: float,
                            task_weight: float, clamp: float | None) -> Tensor:
    """Advantages [G, n, T] from the teacher's and the student's logprobs [G, n, T] of the sampled tokens
    (and, with `task_weight`, the rewards [G, n])."""
    valid = mask.to(student.dtype)
    log_ratio = teacher - student
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    advantages = coef * log_ratio * valid
    if task_weight:
        advantages = advantages + task_weight * group_advantages(rewards, True, False)[..., None] * valid
    return advantages
