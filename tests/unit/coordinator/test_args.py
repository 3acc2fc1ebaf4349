"""The coordinator's deploy arguments: one run at a time until runs can share the cluster."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.coordinator.app import CoordinatorArgs


def test_more_than_one_concurrent_run_is_refused_with_the_reason():
    with pytest.raises(ValidationError, match="runs cannot share the rollout and learner services"):
        CoordinatorArgs.model_validate({"max_concurrent_runs": 2})
    assert CoordinatorArgs.model_validate({}).max_concurrent_runs == 1


def test_retry_policy_is_configured_in_one_place():
    args = CoordinatorArgs.model_validate({"retry": {"retries": 3}})
    assert args.retry.retries == 3 and args.retry.timeout_s == CoordinatorArgs().retry.timeout_s
    with pytest.raises(ValidationError):
        CoordinatorArgs.model_validate({"call_retries": 3})
