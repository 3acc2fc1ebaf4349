"""The gateway's deploy arguments: the cluster file's `tenancy` section, and the old `limits` still read."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.gateway.app import GatewayArgs


def test_the_old_limits_arg_is_read_as_tenancy_callers_and_named_at_start():
    args = GatewayArgs.model_validate({"auth": None, "limits": {"max_streams": 3, "rate": 5.0}})
    again = GatewayArgs.model_validate(args.model_dump())  # the builder validates and dumps, the replica validates
    for a in (args, again):
        assert (a.tenancy.callers.max_streams, a.tenancy.callers.calls_per_s) == (3, 5.0)
        assert a.deprecated_keys == {"limits.max_streams": "tenancy.callers.max_streams",
                                     "limits.rate": "tenancy.callers.calls_per_s"}
    assert GatewayArgs.model_validate({"auth": None}).deprecated_keys == {}
    with pytest.raises(ValidationError, match="limits.rate: deprecated, and tenancy.callers.calls_per_s"):
        GatewayArgs.model_validate({"auth": None, "limits": {"rate": 5.0}, "tenancy": {"callers": {"calls_per_s": 4}}})
