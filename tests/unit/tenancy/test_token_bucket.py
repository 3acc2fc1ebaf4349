"""The one token bucket (`rlserve.tenancy.token_bucket`), on a clock the test moves."""

from __future__ import annotations

import pytest

from rlserve.tenancy import token_bucket
from rlserve.tenancy.token_bucket import TokenBucket


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(token_bucket.time, "monotonic", lambda: now[0])
    return now


def test_a_burst_then_the_rate(clock):
    bucket = TokenBucket(rate=2.0, burst=3)
    assert bucket.full and bucket.level() == 3
    for _ in range(3):
        bucket.take()
    assert bucket.level() == 0 and not bucket.full
    clock[0] += 0.25
    assert bucket.level() == 0.5  # 2 a second
    clock[0] += 10
    assert bucket.level() == 3 and bucket.full  # never more than the burst, however long it was idle


def test_a_cost_known_afterwards_leaves_it_below_zero_until_paid_back(clock):
    bucket = TokenBucket(rate=0.1, burst=2.0)  # seconds of reading a second, as the spec reader uses it
    bucket.take(2.5)
    assert bucket.level() == pytest.approx(-0.5)
    assert bucket.seconds_until(0.0) == pytest.approx(5.0)
    assert bucket.seconds_until(1.0) == pytest.approx(15.0)
    clock[0] += 5.0
    assert bucket.level() == pytest.approx(0.0) and bucket.seconds_until(0.0) == 0.0


@pytest.mark.parametrize("rate, burst", [(0, 1), (1, 0), (-1, 1)])
def test_a_bucket_that_could_never_refill_or_hold_is_refused(rate, burst):
    with pytest.raises(ValueError, match="rate > 0 and burst > 0"):
        TokenBucket(rate, burst)
