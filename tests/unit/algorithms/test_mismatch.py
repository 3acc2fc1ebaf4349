"""The consistency metrics: NeMo-RL's token_mult_prob_error, the k3 generator KL, |delta logprob| and the
truncated share, over micro-batches and split by age and turn; the step objective reports them for any
loss that takes the generator's logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.algorithms.metrics import finalize_metrics, reduce_metric_sums
from rlserve.algorithms.mismatch import mismatch_metrics, mismatch_sums, truncated_by
from rlserve.config import parse_spec
from rlserve.config.algorithms import LossFnCfg
from rlserve.training.batch import TrainBatch
from rlserve.training.objective import StepObjective

LN = math.log


def test_the_metrics_follow_their_definitions():
    # d = prev - gen per token: ln 2, -ln 2, 0 and a masked token that must not count.
    prev = torch.tensor([0.0, -LN(2.0), -1.0, -50.0])
    gen = torch.tensor([-LN(2.0), 0.0, -1.0, 0.0])
    valid = torch.tensor([True, True, True, False])
    m = mismatch_metrics(finalize_values(mismatch_sums(prev, gen, valid, LossFnCfg())))
    # NeMo-RL: mean of exp(|d|) = (2 + 2 + 1) / 3.
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(5 / 3)
    # k3 = exp(d) - 1 - d: (1 - ln 2) + (-0.5 + ln 2) + 0.
    assert m["mismatch/gen_kl_k3"] == pytest.approx(0.5 / 3)
    assert m["mismatch/logprob_abs_diff_mean"] == pytest.approx(2 * LN(2.0) / 3)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(LN(2.0))
    # The default truncation (tis at 2.0) cuts weights above 2: exp(ln 2) = 2 is not above.
    assert m["mismatch/is_truncated_fraction"] == 0.0
    assert not any("/age_" in k or "/turn_" in k for k in m)


def finalize_values(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v) for k, v in sums.items()}


def test_truncation_share_follows_tis_and_icepop():
    w = torch.tensor([0.3, 0.9, 1.5, 2.5])
    assert truncated_by(LossFnCfg(), w).tolist() == [False, False, False, True]
    icepop = LossFnCfg(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=2.0)
    assert truncated_by(icepop, w).tolist() == [True, False, False, True]  # outside [1/2, 2]
    assert not truncated_by(LossFnCfg(truncated_importance_sampling_ratio=None), w).any()


def test_age_and_turn_buckets_split_the_tokens_and_combine_over_micro_batches():
    cfg = LossFnCfg()
    # Two micro-batches; ages 0, 1 and 5 (the "3 or more" bucket), turns 1, 2 and 7 (the "4 or more" one).
    a = mismatch_sums(torch.tensor([0.0, 0.0]), torch.tensor([0.0, -0.1]), torch.tensor([True, True]), cfg,
                      torch.tensor([0, 1]), torch.tensor([1, 2]))
    b = mismatch_sums(torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([True]), cfg,
                      torch.tensor([5]), torch.tensor([7]))
    assert a.keys() == b.keys()  # every bucket present in every micro-batch
    m = finalize_metrics(reduce_metric_sums([a, b]))
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(1.0)
    assert m["mismatch/age_0/logprob_abs_diff_mean"] == 0.0
    assert m["mismatch/age_1/logprob_abs_diff_mean"] == pytest.approx(0.1)
    assert m["mismatch/age_3_plus/logprob_abs_diff_mean"] == pytest.approx(1.0)
    assert m["mismatch/turn_4_plus/tokens"] == 1.0 and m["mismatch/turn_1/tokens"] == 1.0
    assert "mismatch/age_2/tokens" not in m  # an empty bucket is left out, not reported as 0/0


def test_a_minus_infinity_logprob_is_left_out():
    m = mismatch_metrics(finalize_values(mismatch_sums(
        torch.tensor([-1.0, float("-inf")]), torch.tensor([-1.0, -2.0]), torch.tensor([True, True]), LossFnCfg())))
    assert m["mismatch/token_mult_prob_error"] == 1.0 and m["mismatch/logprob_abs_diff_max"] == 0.0


@pytest.mark.parametrize("loss", ["grpo", "cispo"])
def test_the_step_reports_them_for_every_loss_with_generator_logprobs(loss):
    tokens, prompts = [[1, 2, 3, 4], [1, 2, 3]], [2, 2]
    gen = [[-1.0, -1.0], [-1.5]]
    batch = TrainBatch.from_sequences(tokens, prompts, [1.0, -1.0], gen, token_ages=[[0, 0], [1]])
    spec = parse_spec({"loss_fn": {"name": loss}})
    objective = StepObjective(spec, batch, loss, dp_size=1, dp_rank=0, pad_id=0)
    (mb,) = objective.plans[0]
    curr = torch.tensor([-1.0, -1.5, -1.0], requires_grad=True)
    objective.micro_batch_loss(0, mb, curr, None)
    m = objective.finalize(None)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(0.5)
    assert m["mismatch/age_0/logprob_abs_diff_mean"] == pytest.approx(0.25)
    assert m["mismatch/age_1/logprob_abs_diff_mean"] == pytest.approx(0.5)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx((1 + 2 * math.exp(0.5)) / 3)


def test_sft_batches_have_no_consistency_metrics():
    batch = TrainBatch.from_sequences([[1, 2, 3]], [1])
    objective = StepObjective(parse_spec({}), batch, "sft", dp_size=1, dp_rank=0, pad_id=0)
    (mb,) = objective.plans[0]
    objective.micro_batch_loss(0, mb, torch.tensor([-1.0, -1.0], requires_grad=True), None)
    assert not any(k.startswith("mismatch/") for k in objective.finalize(None))


def test_the_guard_watches_exactly_the_metrics_the_learner_reports():
    from rlserve.algorithms.mismatch import _MEANS
    from rlserve.config.algorithms import MISMATCH_METRICS

    assert set(MISMATCH_METRICS) == {*_MEANS, "logprob_abs_diff_max"}
