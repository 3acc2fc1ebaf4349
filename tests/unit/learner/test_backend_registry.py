"""Learner backends by name: every entry's class and model check import, and the check goes
through the entry of the spec's backend."""

from __future__ import annotations

import pytest

from rlserve.catalog import LEARNER_BACKENDS
from rlserve.config import parse_spec
from rlserve.learner.interfaces import LearnerBackend
from rlserve.learner.registry import UnsupportedModel, check_model
from rlserve.registry import import_object


@pytest.mark.parametrize("name", LEARNER_BACKENDS.names)
def test_every_entry_names_a_backend_and_a_model_check(name):
    entry = LEARNER_BACKENDS[name]
    assert issubclass(import_object(entry.backend), LearnerBackend)
    assert callable(import_object(entry.check_model))


def test_check_model_asks_the_spec_backends_check(monkeypatch):
    asked = []

    def refuse(spec, hf_config):
        asked.append(spec.policy.backend)
        raise UnsupportedModel("policy.megatron_cfg", "no")

    monkeypatch.setattr("rlserve.learner.megatron.support.check_model", refuse)
    with pytest.raises(UnsupportedModel):
        check_model(parse_spec({"policy": {"megatron_cfg": {"enabled": True}}}), object())
    assert asked == ["megatron"]


def test_unknown_backend_names_fail_listing_the_valid_ones():
    with pytest.raises(ValueError, match="unknown learner backend 'jax'; valid: dtensor, megatron"):
        LEARNER_BACKENDS["jax"]
