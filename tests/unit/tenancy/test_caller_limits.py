"""Each caller's share of the endpoint (`rlserve.tenancy.callers.Limiter`), without a server: the gateway's
tests (tests/unit/gateway) show the same limits through gRPC."""

from __future__ import annotations

import pytest

from rlserve.tenancy import token_bucket
from rlserve.tenancy.callers import Limiter
from rlserve.tenancy.policy import CallerLimits, OverLimit


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(token_bucket.time, "monotonic", lambda: now[0])
    return now


def test_streams_and_calls_in_flight_are_counted_per_caller(clock):
    limiter = Limiter(CallerLimits(max_streams=1, max_calls_in_flight=2))
    limiter.admit("alice", streaming=True, request_bytes=10, public=True)
    with pytest.raises(OverLimit, match=r"tenancy\.callers\.max_streams"):
        limiter.admit("alice", streaming=True, request_bytes=10, public=True)
    limiter.admit("bob", streaming=True, request_bytes=10, public=True)  # every caller has their own
    limiter.admit("alice", streaming=False, request_bytes=10, public=True)
    limiter.admit("alice", streaming=False, request_bytes=10, public=True)
    with pytest.raises(OverLimit, match=r"tenancy\.callers\.max_calls_in_flight"):
        limiter.admit("alice", streaming=False, request_bytes=10, public=True)
    limiter.release("alice", streaming=False)
    limiter.admit("alice", streaming=False, request_bytes=10, public=True)
    limiter.release("alice", streaming=True)
    limiter.admit("alice", streaming=True, request_bytes=10, public=True)


def test_calls_a_second_in_bursts(clock):
    limiter = Limiter(CallerLimits(calls_per_s=2, call_burst=3))
    for _ in range(3):
        limiter.admit("alice", streaming=False, request_bytes=0, public=True)
        limiter.release("alice", streaming=False)
    with pytest.raises(OverLimit, match=r"more than 2 calls per second \(tenancy\.callers\.calls_per_s"):
        limiter.admit("alice", streaming=False, request_bytes=0, public=True)
    clock[0] += 0.5  # one call's worth back
    limiter.admit("alice", streaming=False, request_bytes=0, public=True)
    with pytest.raises(OverLimit):
        limiter.admit("alice", streaming=False, request_bytes=0, public=True)


def test_the_request_size_bounds_public_rpcs_only(clock):
    limiter = Limiter(CallerLimits(max_request_kb=1))
    limiter.admit("alice", streaming=False, request_bytes=1024, public=True)
    with pytest.raises(OverLimit, match=r"tenancy\.callers\.max_request_kb"):
        limiter.admit("alice", streaming=False, request_bytes=1025, public=True)
    limiter.admit("admin", streaming=False, request_bytes=10 * 2**20, public=False)  # a training batch


def test_an_idle_caller_is_forgotten_once_its_bucket_is_full_again(clock):
    limiter = Limiter(CallerLimits(calls_per_s=1, call_burst=2))
    limiter.admit("alice", streaming=False, request_bytes=0, public=True)
    limiter.release("alice", streaming=False)
    assert "alice" in limiter._callers  # it owes a call: forgetting it would give it a fresh burst
    clock[0] += 1.0
    limiter.admit("alice", streaming=False, request_bytes=0, public=True)
    clock[0] += 1.0
    limiter.release("alice", streaming=False)
    assert "alice" not in limiter._callers
