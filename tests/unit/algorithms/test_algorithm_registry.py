"""Losses and advantage estimators by name: every entry builds and declares its needs; unknown
names fail listing the valid ones."""

from __future__ import annotations

import pytest
import torch

from rlserve.algorithms.interfaces import AdvantageEstimator, AdvantageInputs, Loss
from rlserve.algorithms.registry import advantage_estimator, make_loss
from rlserve.catalog import ADVANTAGE_ESTIMATORS, LOSSES
from rlserve.config.spec import AdvEstimatorCfg, LossFnCfg

DECLARATIONS = ("needs_generator_logprobs", "needs_prev_logprobs", "minibatched", "needs_reference_logprobs",
                "token_level")


@pytest.mark.parametrize("name", LOSSES.names)
def test_every_registered_loss_builds_and_declares_its_needs(name):
    loss = make_loss(name, LossFnCfg())
    assert isinstance(loss, Loss)
    assert all(isinstance(getattr(loss, d), bool) for d in DECLARATIONS)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names)
def test_every_registered_advantage_estimator_builds(name):
    estimator = advantage_estimator(AdvEstimatorCfg(name=name), LossFnCfg())
    assert isinstance(estimator, AdvantageEstimator)
    assert isinstance(estimator.token_level, bool) and isinstance(estimator.needs_reference_logprobs, bool)
    mask = torch.tensor([[[True, True], [True, False], [True, True]]])
    reference = torch.full((1, 3, 2), -1.0) if estimator.needs_reference_logprobs else None
    out = estimator(AdvantageInputs(torch.tensor([[1.0, 0.0, 0.5]]), mask, torch.zeros(1, 3, 2), reference))
    assert out.shape == ((1, 3, 2) if estimator.token_level else (1, 3))


def test_unknown_names_fail_listing_the_valid_ones():
    with pytest.raises(ValueError, match="unknown loss 'ppo'; valid: grpo, cispo, sft"):
        make_loss("ppo", LossFnCfg())
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'; valid: grpo, reinforce_plus_plus, on_policy_distillation"):
        advantage_estimator(AdvEstimatorCfg.model_construct(name="gae"), LossFnCfg())


def test_grpo_declares_what_its_configuration_uses():
    grpo = make_loss("grpo", LossFnCfg())
    assert grpo.needs_generator_logprobs and grpo.needs_prev_logprobs and grpo.minibatched
    assert not grpo.needs_reference_logprobs and grpo.token_level
    kl_per_sequence = make_loss("grpo", LossFnCfg(reference_policy_kl_penalty=0.1, token_level_loss=False))
    assert kl_per_sequence.needs_reference_logprobs and not kl_per_sequence.token_level


def test_sft_needs_only_the_policy_and_counts_tokens():
    sft = make_loss("sft", LossFnCfg(reference_policy_kl_penalty=0.1, token_level_loss=False))
    assert not any(getattr(sft, d) for d in DECLARATIONS if d != "token_level")
    assert sft.token_level
