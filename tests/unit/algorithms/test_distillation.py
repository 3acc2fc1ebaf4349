"""The on_policy_distillation estimator against its formula on fixed tensors: each token's advantage is
the teacher's minus the student's logprob of the sampled token (clamped), plus the task reward's GRPO
advantage when weighted in; and the spec keys that make a distillation run."""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.algorithms.interfaces import AdvantageInputs
from rlserve.algorithms.registry import advantage_estimator
from rlserve.config import SpecError, parse_spec
from rlserve.config.algorithms import AdvEstimatorCfg, LossFnCfg

F64 = torch.float64
REWARDS = [[1.0, 0.0], [0.5, 0.5]]  # the second group ties: the teacher still has something to say
LENGTHS = [[3, 1], [2, 3]]
STUDENT = [[[-0.5, -1.0, -0.2], [-0.3]], [[-1.5, -0.4], [-0.9, -0.1, -2.0]]]
TEACHER = [[[-0.7, -0.9, -0.6], [-0.1]], [[-1.0, -40.0], [-1.2, -0.3, -1.0]]]  # -40: clamped to a -20 log-ratio


def inputs() -> AdvantageInputs:
    mask = torch.zeros(2, 2, 3, dtype=torch.bool)
    student, teacher = torch.zeros(2, 2, 3, dtype=F64), torch.zeros(2, 2, 3, dtype=F64)
    for i in range(2):
        for j in range(2):
            n = LENGTHS[i][j]
            mask[i, j, :n] = True
            student[i, j, :n] = torch.tensor(STUDENT[i][j], dtype=F64)
            teacher[i, j, :n] = torch.tensor(TEACHER[i][j], dtype=F64)
    return AdvantageInputs(torch.tensor(REWARDS, dtype=F64), mask, student, teacher)


def formula(coef: float, task_weight: float) -> list[list[list[float]]]:
    out = []
    for i in range(2):
        mean = sum(REWARDS[i]) / 2
        std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS[i]) / (2 - 1))  # the group's unbiased std
        group = []
        for j in range(2):
            task = (REWARDS[i][j] - mean) / (std + 1e-6)
            row = [coef * max(-20.0, min(20.0, t - s)) + task_weight * task
                   for s, t in zip(STUDENT[i][j], TEACHER[i][j])]
            group.append(row + [0.0] * (3 - len(row)))
        out.append(group)
    return out


@pytest.mark.parametrize("coef, task_weight", [(1.0, 0.0), (0.5, 2.0)])
def test_each_token_gets_the_clamped_teacher_student_log_ratio_plus_the_weighted_task_advantage(coef, task_weight):
    est = advantage_estimator(AdvEstimatorCfg(name="on_policy_distillation", teacher_kl_coef=coef,
                                              task_reward_weight=task_weight), LossFnCfg())
    assert est.token_level and est.needs_reference_logprobs and not est.group_relative
    got = est(inputs())
    assert torch.allclose(got, torch.tensor(formula(coef, task_weight), dtype=F64), atol=1e-6)
    assert got[~inputs().mask].abs().max() == 0


def test_the_reported_reverse_kl_is_the_mean_student_minus_teacher_log_ratio_over_sampled_tokens():
    est = advantage_estimator(AdvEstimatorCfg(name="on_policy_distillation"), LossFnCfg())
    ratios = [s - t for i in range(2) for j in range(2) for s, t in zip(STUDENT[i][j], TEACHER[i][j])]
    assert est.metrics(inputs())["distillation/reverse_kl"] == pytest.approx(sum(ratios) / len(ratios), abs=1e-9)
    with pytest.raises(ValueError, match="teacher"):
        est(AdvantageInputs(inputs().rewards, inputs().mask, inputs().gen_logprobs, None))


def problems(data: dict) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    return err.value.problems


DISTILL = {"grpo": {"adv_estimator": {"name": "on_policy_distillation"}}}


def test_a_distillation_spec_names_its_teacher_and_reads_the_teacher_through_the_reference_service():
    spec = parse_spec({**DISTILL, "teacher": {"model_name": "preset:tiny", "model_seed": 1}})
    assert spec.reference_from_service and not spec.reference_to_learner
    assert not parse_spec({}).reference_from_service


@pytest.mark.parametrize("data, path", [
    (DISTILL, "teacher.model_name"),  # no teacher
    ({"teacher": {"model_name": "preset:tiny"}}, "teacher.model_name"),  # a teacher nothing reads
    ({**DISTILL, "teacher": {"model_name": "preset:tiny"}, "loss_fn": {"reference_policy_kl_penalty": 0.1}},
     "loss_fn.reference_policy_kl_penalty"),
    ({"grpo": {**DISTILL["grpo"], "use_dynamic_sampling": True}, "teacher": {"model_name": "preset:tiny"}},
     "grpo.use_dynamic_sampling"),
    ({"grpo": {"adv_estimator": {"teacher_kl_coef": 2.0}}}, "grpo.adv_estimator.teacher_kl_coef"),
])
def test_distillation_keys_are_checked_with_the_key_named(data, path):
    assert problems(data)[0].startswith(path + ":")
