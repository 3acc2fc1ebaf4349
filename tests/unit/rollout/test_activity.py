"""Engine idle time: idle with no request or while paused, busy otherwise."""

from __future__ import annotations

import pytest

from rlserve.rollout import activity
from rlserve.rollout.activity import Activity


@pytest.fixture()
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(activity.time, "monotonic", lambda: now[0])
    return now


def test_idle_busy_and_paused_time_add_up(clock):
    a = Activity()
    clock[0] += 2  # nothing to do: idle
    a.request_started()
    clock[0] += 3  # generating: busy
    a.request_started()
    a.request_finished()
    clock[0] += 1  # still one request: busy
    a.paused()
    clock[0] += 0.5  # held by a weight update: idle and paused
    a.resumed()
    clock[0] += 1  # busy again
    a.request_finished()
    clock[0] += 4  # idle
    s = a.stats()
    assert s.uptime_s == pytest.approx(11.5)
    assert s.idle_s == pytest.approx(2 + 0.5 + 4)
    assert s.paused_s == pytest.approx(0.5)
    assert s.requests_running == 0


def test_a_pause_with_nothing_running_counts_once(clock):
    a = Activity()
    a.paused()
    clock[0] += 2
    a.resumed()
    s = a.stats()
    assert (s.idle_s, s.paused_s) == (pytest.approx(2), pytest.approx(2))
