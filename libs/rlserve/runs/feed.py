"""The run table's feed: every run's record as it changes, for the gateway's copy (`rlserve.gateway.run_table`).

GetRun and ListRuns were most of what callers send, and each crossed a Serve
hop to the coordinator and back (~4 ms of CPU between gateway and coordinator
on 2 cores: BENCHMARKS.md, the soak). A run changes at the pace of its steps,
so the coordinator sends each change once and the gateway answers reads from
its copy.

The first batch of a feed is every run; later batches hold the runs whose
record changed, checked every `interval_s` while a run is unfinished. Unfinished
runs are checked each time; finished ones when their `updated` time moved (a
resume), and all of them every `FULL_CHECK_EVERY` batches, so a field set
without a new event still reaches the gateway. With every run finished nothing
changes until a run arrives (submitted, resumed or opened: `Arrivals`), so an
idle feed sleeps until one does, or `idle_s` passes and it checks everything
once: an idle coordinator does not wake ten times a second for nothing.
A feed ends after `max_s` and the gateway opens the
next one at once, whose first batch is everything again: the copy is rebuilt
from the coordinator's runs at least that often, and no stream is held for good
(as a WatchRun stream ends after `watch_max_s`).

Each batch also carries the new events of unfinished runs (the first batch
their last `EVENTS_TAIL`), so the gateway answers most WatchRun streams from
its copy too (`rlserve.gateway.run_events`): a watcher waiting for a run's next
step then holds nothing at the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from rlserve.runs.record import TERMINAL, Run

log = logging.getLogger("rlserve.runs")

FULL_CHECK_EVERY = 20
# A run's newest events in a feed's first batch: a watcher that starts further back is served by the coordinator.
EVENTS_TAIL = 256


@dataclass
class FeedBatch:
    runs: list[bytes] = field(default_factory=list)  # serialized `rlserve.v1.Run` records
    events: list[bytes] = field(default_factory=list)  # serialized `rlserve.v1.RunEvent`s, in order for each run


class Arrivals:
    """The runs a manager took in (submitted, resumed, opened), counted, so that an idle feed sleeps until the next."""

    def __init__(self) -> None:
        self.count = 0
        self._next = asyncio.Event()

    def note(self) -> None:
        self.count += 1
        self._next.set()
        self._next = asyncio.Event()

    async def wait(self, after: int, timeout_s: float) -> None:
        """Until a run arrives after the `after`th, or `timeout_s` passes."""
        if self.count > after:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._next.wait(), timeout_s)


def _new_events(run: Run, sent: dict[str, int]) -> list[bytes]:
    """The events of `run` the feed has not sent: for a run it did not follow yet, its last `EVENTS_TAIL`.
    A run is followed while unfinished, and until its last event (its end) is sent; a finished run is not
    read again (its events may have been let go to disk)."""
    if run.state in TERMINAL and run.run_id not in sent:
        return []
    events = run.events
    start = sent.get(run.run_id, max(0, len(events) - EVENTS_TAIL))
    if run.state in TERMINAL:
        sent.pop(run.run_id)
    else:
        sent[run.run_id] = len(events)
    return [ev.SerializeToString() for ev in events[start:]]


async def run_feed(runs: Callable[[], dict[str, Run]], interval_s: float, max_s: float,
                   arrivals: Arrivals | None = None, idle_s: float | None = None) -> AsyncIterator[FeedBatch]:
    """All runs first, then those that changed, with the new events of unfinished runs, for `max_s`. With
    `arrivals`, a feed whose runs are all finished waits for the next arrival, at most `idle_s`; without, it
    looks every `interval_s` whatever the runs do."""
    if arrivals is not None and not (idle_s and idle_s > 0):
        raise ValueError(f"a feed that waits for arrivals needs idle_s > 0, got {idle_s}")
    sent: dict[str, bytes] = {}
    checked_at: dict[str, float] = {}  # run id -> its `updated` when last checked
    events_sent: dict[str, int] = {}  # run id -> how many of its events were sent
    tick = 0
    full = True  # this tick checks every run
    deadline = time.monotonic() + max_s
    while tick == 0 or time.monotonic() < deadline:
        batch = FeedBatch()
        seen = arrivals.count if arrivals is not None else 0
        current = runs()
        for run_id, run in current.items():
            batch.events.extend(_new_events(run, events_sent))
            if not full and run.state in TERMINAL and checked_at.get(run_id) == run.updated:
                continue
            checked_at[run_id] = run.updated
            try:
                data = run.to_proto().SerializeToString()
            except (ValueError, TypeError) as err:  # as ListRuns: one bad record must not hide the others
                log.warning("run %s cannot be listed: %s", run_id, err)
                continue
            if sent.get(run_id) != data:
                sent[run_id] = data
                batch.runs.append(data)
        if batch.runs or batch.events or tick == 0:
            yield batch
        tick += 1
        full = tick % FULL_CHECK_EVERY == 0
        if arrivals is not None and all(run.state in TERMINAL for run in current.values()):
            await arrivals.wait(seen, min(idle_s, max(0.0, deadline - time.monotonic())))
            full = True
        else:
            await asyncio.sleep(interval_s)
