"""Weighted fair share of one contended resource between the runs that use it, by what they use.

Runs sharing a cluster share its rollout engines' generation slots (counted in
tokens) and its learner workers (counted in seconds). First come, first served
would give a run with 10x longer completions 10x the engines, and a run that
sends more requests more of them. This is start-time fair queueing (Goyal et
al., SIGCOMM 1996) for costs known only afterwards:

- each run has a virtual time: what it used over its weight (its `priority`);
- when the resource has room, the waiting request of the run with the lowest
  virtual time starts; it is charged an estimate then, and what it really used
  when it ends;
- a run coming back after an idle spell starts at the system's virtual time
  (where the last request let in started), so idleness banks no credit, and a
  run that merely paused between two of its calls keeps what it owes.

A run alone goes straight through: with no other run present or recently seen
(`linger_s`), every request starts at once (the resource's own queue orders
them), so one run trains exactly as it would without this. The linger keeps a
run whose requests all ended a moment ago from being taken as gone, which
would let the other run flood the resource in that moment. An `exclusive`
resource (a learner group: one call at a time) lets nobody through that way.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

from rlserve.config.section import MAX_PRIORITY


@dataclass
class Grant:
    """A request let in: give it back to `FairShare.release` with what it used."""

    run_id: str
    units: int
    estimate: float


@dataclass
class _Waiter:
    seq: int
    units: int
    estimate: float
    future: asyncio.Future


@dataclass
class _Run:
    weight: float
    vtime: float = 0.0
    in_flight: int = 0  # requests started, not ended
    ended: float = -math.inf  # time.monotonic() when its last request ended
    waiting: deque[_Waiter] = field(default_factory=deque)

    @property
    def present(self) -> bool:
        return bool(self.in_flight or self.waiting)


class FairShare:
    """A resource of `capacity` units (sequences an engine runs at once; 1 for a learner group) shared by
    runs in proportion to their weights, counting what each request used. The next request starts
    whenever a unit is free, whatever its size (the resource's own queue holds what does not fit): a
    request's units stay taken until all of its sequences end, so waiting for all of them to fit would
    leave the engine idle behind a long request's last sequences."""

    def __init__(self, capacity: int, linger_s: float = 2.0, exclusive: bool = False):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.linger_s, self.exclusive = capacity, linger_s, exclusive
        self._runs: dict[str, _Run] = {}
        self._units = 0  # units of the requests running
        # The system's virtual time: the start (the run's virtual time before the charge) of the last
        # request let in; the highest virtual time once nothing runs or waits.
        self._clock = 0.0
        self._seq = itertools.count()

    async def acquire(self, run_id: str, weight: float, units: int = 1, estimate: float = 0.0) -> Grant:
        """Wait for the run's turn. `weight` > 0 (the run's priority), `units` of the capacity taken,
        `estimate` of what the request will use (charged now, corrected by `release`)."""
        if not 0 < weight <= MAX_PRIORITY:
            raise ValueError(f"weight must be in (0, {MAX_PRIORITY:g}], got {weight}")
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _Run(weight, self._clock)
        elif not run.present:
            run.vtime = max(run.vtime, self._clock)
        run.weight = weight
        waiter = _Waiter(next(self._seq), max(1, units), max(0.0, estimate),
                         asyncio.get_running_loop().create_future())
        run.waiting.append(waiter)
        self._dispatch()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():  # let in as it was cancelled
                self.release(Grant(run_id, waiter.units, waiter.estimate), 0.0)
            else:
                if waiter in run.waiting:  # `_dispatch` may have dropped it already
                    run.waiting.remove(waiter)
                self._forget_idle()
                self._dispatch()
            raise
        return Grant(run_id, waiter.units, waiter.estimate)

    def release(self, grant: Grant, used: float) -> None:
        """The request ended, having used `used` (tokens, seconds: the resource's unit)."""
        run = self._runs[grant.run_id]
        run.in_flight -= 1
        run.ended = time.monotonic()
        run.vtime += (used - grant.estimate) / run.weight
        self._units -= grant.units
        self._forget_idle()
        self._dispatch()

    def _dispatch(self) -> None:
        while True:
            for r in self._runs.values():
                # A cancelled task's wait is cancelled at once and its handler in `acquire` runs a moment
                # later: such a request must not be let in meanwhile.
                while r.waiting and r.waiting[0].future.done():
                    r.waiting.popleft()
            waiting = [(r.vtime, r.waiting[0].seq, run_id) for run_id, r in self._runs.items() if r.waiting]
            if not waiting:
                return
            _, _, run_id = min(waiting)
            run = self._runs[run_id]
            waiter = run.waiting[0]
            now = time.monotonic()
            alone = not self.exclusive and all(r is run or not self._seen(r, now) for r in self._runs.values())
            if not (alone or self._units < self.capacity):
                return
            run.waiting.popleft()
            self._clock = max(self._clock, run.vtime)
            run.vtime += waiter.estimate / run.weight
            run.in_flight += 1
            self._units += waiter.units
            waiter.future.set_result(None)

    def _seen(self, run: _Run, now: float) -> bool:
        return run.present or now - run.ended < self.linger_s

    def _forget_idle(self) -> None:
        """Drop absent runs ahead of the clock by nothing: they would come back at the clock anyway (memory
        stays bounded by the runs present and those that owe). An idle resource owes nobody anything."""
        now = time.monotonic()
        if not any(r.present for r in self._runs.values()):
            self._clock = max([self._clock, *(r.vtime for r in self._runs.values())])
        for run_id in [k for k, r in self._runs.items() if not self._seen(r, now) and r.vtime <= self._clock]:
            del self._runs[run_id]
