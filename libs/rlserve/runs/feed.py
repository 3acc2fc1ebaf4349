"""The run table's feed: every run's record as it changes, for the gateway's copy (`rlserve.gateway.run_table`).

GetRun and ListRuns were most of what callers send, and each crossed a Serve
hop to the coordinator and back (~4 ms of CPU between gateway and coordinator
on 2 cores: BENCHMARKS.md, the soak). A run changes at the pace of its steps,
so the coordinator sends each change once and the gateway answers reads from
its copy.

The first batch of a feed is every run; later batches hold the runs whose
record changed, checked every `interval_s`. Unfinished runs are checked each
time; finished ones when their `updated` time moved (a resume), and all of
them every `FULL_CHECK_EVERY` batches, so a field set without a new event
still reaches the gateway. A feed ends after `max_s` and the gateway opens the
next one at once, whose first batch is everything again: the copy is rebuilt
from the coordinator's runs at least that often, and no stream is held for good
(as a WatchRun stream ends after `watch_max_s`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from rlserve.runs.record import TERMINAL, Run

log = logging.getLogger("rlserve.runs")

FULL_CHECK_EVERY = 20


async def run_feed(runs: Callable[[], dict[str, Run]], interval_s: float, max_s: float
                   ) -> AsyncIterator[list[bytes]]:
    """Batches of serialized `rlserve.v1.Run` records: all runs first, then those that changed, for `max_s`."""
    sent: dict[str, bytes] = {}
    checked_at: dict[str, float] = {}  # run id -> its `updated` when last checked
    tick = 0
    deadline = time.monotonic() + max_s
    while tick == 0 or time.monotonic() < deadline:
        changed = []
        for run_id, run in runs().items():
            if (tick % FULL_CHECK_EVERY and run.state in TERMINAL and checked_at.get(run_id) == run.updated):
                continue
            checked_at[run_id] = run.updated
            try:
                data = run.to_proto().SerializeToString()
            except (ValueError, TypeError) as err:  # as ListRuns: one bad record must not hide the others
                log.warning("run %s cannot be listed: %s", run_id, err)
                continue
            if sent.get(run_id) != data:
                sent[run_id] = data
                changed.append(data)
        if changed or tick == 0:
            yield changed
        tick += 1
        await asyncio.sleep(interval_s)
