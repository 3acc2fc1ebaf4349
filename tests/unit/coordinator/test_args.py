"""The coordinator's deploy arguments: the retry policy is configured in one place, unknown keys are refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.coordinator.app import CoordinatorArgs


def test_retry_policy_is_configured_in_one_place():
    args = CoordinatorArgs.model_validate({"retry": {"retries": 3}})
    assert args.retry.retries == 3 and args.retry.timeout_s == CoordinatorArgs().retry.timeout_s
    with pytest.raises(ValidationError):
        CoordinatorArgs.model_validate({"call_retries": 3})
