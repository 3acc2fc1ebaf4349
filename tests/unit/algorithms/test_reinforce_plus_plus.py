"""The reinforce_plus_plus estimator against REINFORCE++'s formula (arXiv:2501.03262) on fixed
tensors: per-token returns with the KL in the reward, normalised over the whole batch; and the
gradient those per-token advantages give through the learner's batch and the grpo loss."""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.algorithms.interfaces import AdvantageInputs
from rlserve.algorithms.registry import advantage_estimator, make_loss
from rlserve.config import SpecError, parse_spec
from rlserve.config.algorithms import AdvEstimatorCfg, LossFnCfg
from rlserve.training.batch import TrainBatch
from rlserve.training.objective import StepObjective

F64 = torch.float64
# Two groups of two samples; completions of 3, 1, 2 and 3 tokens.
REWARDS = [[1.0, 0.0], [0.5, 0.25]]
LENGTHS = [[3, 1], [2, 3]]
GEN = [[[-0.5, -1.0, -0.2], [-0.3]], [[-1.5, -0.4], [-0.9, -0.1, -2.0]]]
REF = [[[-0.7, -0.9, -0.6], [-0.1]], [[-1.0, -0.4], [-1.2, -0.3, -1.0]]]
BETA = 0.1


def inputs(with_reference: bool) -> AdvantageInputs:
    mask = torch.zeros(2, 2, 3, dtype=torch.bool)
    gen, ref = torch.zeros(2, 2, 3, dtype=F64), torch.zeros(2, 2, 3, dtype=F64)
    for i in range(2):
        for j in range(2):
            n = LENGTHS[i][j]
            mask[i, j, :n] = True
            gen[i, j, :n] = torch.tensor(GEN[i][j], dtype=F64)
            ref[i, j, :n] = torch.tensor(REF[i][j], dtype=F64)
    return AdvantageInputs(torch.tensor(REWARDS, dtype=F64), mask, gen, ref if with_reference else None)


def formula(kl_in_reward: bool, minus_baseline: bool) -> list[list[list[float]]]:
    """Token by token: r_t = 1[t = T] R - beta KL_t with KL_t = log pi_old - log pi_ref (k1), A_t = sum_{s >= t}
    r_s, then (A - mean) / std over every token of the batch (population std)."""
    returns = []
    for i, group in enumerate(REWARDS):
        mean = sum(group) / len(group)
        for j, score in enumerate(group):
            r = score - mean if minus_baseline else score
            kl = [g - f for g, f in zip(GEN[i][j], REF[i][j])] if kl_in_reward else [0.0] * LENGTHS[i][j]
            returns.append([r - BETA * sum(kl[t:]) for t in range(LENGTHS[i][j])])
    flat = [a for row in returns for a in row]
    mu = sum(flat) / len(flat)
    sd = math.sqrt(sum((a - mu) ** 2 for a in flat) / len(flat))
    return [[(a - mu) / sd for a in row] for row in returns]


def estimate(kl_in_reward: bool, minus_baseline: bool) -> torch.Tensor:
    loss_cfg = LossFnCfg(use_kl_in_reward=True, reference_policy_kl_penalty=BETA if kl_in_reward else 0.0,
                         reference_policy_kl_type="k1")
    est = advantage_estimator(AdvEstimatorCfg(name="reinforce_plus_plus", minus_baseline=minus_baseline), loss_cfg)
    assert est.token_level and est.needs_reference_logprobs == kl_in_reward
    return est(inputs(kl_in_reward))


@pytest.mark.parametrize("kl_in_reward", [True, False])
@pytest.mark.parametrize("minus_baseline", [True, False])
def test_matches_the_formula(kl_in_reward, minus_baseline):
    got = estimate(kl_in_reward, minus_baseline)
    expected = formula(kl_in_reward, minus_baseline)
    rows = [got[i, j, :LENGTHS[i][j]].tolist() for i in range(2) for j in range(2)]
    assert [a for row in rows for a in row] == pytest.approx([a for row in expected for a in row], abs=1e-6)
    assert got[~inputs(False).mask].abs().max().item() == 0.0  # nothing past a completion's end


def test_the_batch_is_normalised_over_tokens_not_groups():
    got = estimate(True, True)
    valid = got[inputs(False).mask]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert valid.var(correction=0).item() == pytest.approx(1.0, abs=1e-9)


def test_per_token_advantages_reach_the_loss_and_its_gradient():
    """The learner's path: TrainBatch.token_advantages -> micro-batches (any split) -> the grpo loss,
    whose gradient per token is -A_t r_t / N (one update per step: r = 1)."""
    adv = estimate(True, True)
    seqs, prompt_lens, token_adv, gen = [], [], [], []
    for i in range(2):
        for j in range(2):
            n = LENGTHS[i][j]
            seqs.append([1, 2] + [3 + t for t in range(n)])
            prompt_lens.append(2)
            token_adv.append(adv[i, j, :n].tolist())
            gen.append(GEN[i][j])
    batch = TrainBatch.from_sequences(seqs, prompt_lens, None, gen, None, token_advantages=token_adv)
    spec = parse_spec({"policy": {"train_micro_batch_size": 3}, "loss_fn": {"use_kl_in_reward": True},
                       "grpo": {"adv_estimator": {"name": "reinforce_plus_plus"}}})
    objective = StepObjective(spec, batch, "grpo", dp_size=1, dp_rank=0, pad_id=0)
    total = sum(sum(LENGTHS, []))
    for mb in objective.plans[0]:
        curr = torch.zeros(len(mb.advantages), requires_grad=True)
        objective.micro_batch_loss(0, mb, curr, None).backward()
        torch.testing.assert_close(curr.grad, -mb.advantages / total)
    seen = torch.cat([mb.advantages for mb in objective.plans[0]])
    torch.testing.assert_close(seen, torch.tensor([a for row in token_adv for a in row]))


def test_the_kl_goes_into_the_reward_and_out_of_the_loss():
    loss = make_loss("grpo", LossFnCfg(use_kl_in_reward=True, reference_policy_kl_penalty=0.1))
    assert not loss.needs_reference_logprobs
    spec = parse_spec({"loss_fn": {"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.1},
                       "grpo": {"adv_estimator": {"name": "reinforce_plus_plus"}}})
    assert spec.reference_from_service and not spec.reference_to_learner


@pytest.mark.parametrize("data, field", [
    ({"loss_fn": {"use_kl_in_reward": True}}, "loss_fn.use_kl_in_reward"),
    ({"grpo": {"adv_estimator": {"name": "reinforce_plus_plus", "use_leave_one_out_baseline": True}}},
     "grpo.adv_estimator.use_leave_one_out_baseline"),
    ({"grpo": {"adv_estimator": {"minus_baseline": False}}}, "grpo.adv_estimator.minus_baseline"),
])
def test_the_spec_refuses_keys_of_another_estimator(data, field):
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    assert err.value.problems[0].startswith(field + ":")
