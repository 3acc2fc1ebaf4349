"""The gateway's copy of unfinished runs' newest events: WatchRun answered without a stream at the coordinator.

A WatchRun stream mostly waits: for a run's next step, or for a queued run to
start. Forwarded, each held a Serve request at the coordinator and cost a hop
per event. The coordinator's feed (`rlserve.runs.feed`) sends each unfinished
run's events once; the gateway keeps the newest `EVENTS_TAIL` of each and
serves every watcher from them.

A watcher is served here only while its next event is in the copy. When it
is not (it starts further back, it fell behind the tail, the feed went down,
the next feed's first batch let the run's events go), `follow` raises
`NotHeld` and the gateway forwards the rest of the stream from the watcher's
next sequence number: nothing is lost or sent twice. A stream ends after the
event that ends the run (its state is terminal), or after `max_s`, as the
coordinator's own streams do.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable

from rlserve.runs.feed import EVENTS_TAIL
from rlserve.runs.record import TERMINAL
from rlserve.v1 import coordinator_pb2 as pb


class NotHeld(Exception):
    """The watcher's next event is not in the copy: forward the rest of its stream."""


class _Tail:
    """One run's newest events, sequence numbers `first` up to `next - 1`, without a gap."""

    def __init__(self, first: int):
        self.first = first
        self.events: deque[pb.RunEvent] = deque(maxlen=EVENTS_TAIL)
        self.changed = asyncio.Event()

    @property
    def next(self) -> int:
        return self.first + len(self.events)

    def add(self, ev: pb.RunEvent) -> bool:
        """False: `ev` leaves a gap after what is held."""
        if ev.sequence > self.next:
            return False
        if ev.sequence == self.next:
            if len(self.events) == self.events.maxlen:
                self.first += 1
            self.events.append(ev)
        return True

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class RunEvents:
    def __init__(self) -> None:
        self._tails: dict[str, _Tail] = {}

    def add(self, events: Iterable[pb.RunEvent]) -> None:
        """Events of the feed, in order for each run; a gap starts the run's copy again from the new event."""
        woken = set()
        for ev in events:
            tail = self._tails.get(ev.run_id)
            if tail is None or not tail.add(ev):
                if tail is not None:
                    tail.wake()
                tail = self._tails[ev.run_id] = _Tail(ev.sequence)
                tail.add(ev)
            woken.add(ev.run_id)
        for run_id in woken:
            self._tails[run_id].wake()

    def keep_only(self, run_ids: set[str]) -> None:
        """Let go of every other run's events (a feed's first batch names the runs it follows)."""
        for run_id in [r for r in self._tails if r not in run_ids]:
            self._tails.pop(run_id).wake()

    def holds(self, run_id: str, sequence: int) -> bool:
        tail = self._tails.get(run_id)
        return tail is not None and tail.first <= sequence

    async def follow(self, run_id: str, sequence: int, max_s: float) -> AsyncIterator[pb.RunEvent]:
        """The run's events from `sequence` on until the run ends or `max_s` pass; `NotHeld` as soon as
        the next one is not in the copy."""
        deadline = time.monotonic() + max_s
        while True:
            tail = self._tails.get(run_id)
            if tail is None or sequence < tail.first:
                raise NotHeld(run_id)
            while sequence < tail.next:
                yield tail.events[sequence - tail.first]
                sequence += 1
                if self._tails.get(run_id) is not tail or sequence < tail.first:
                    break  # replaced, or moved on while the watcher was slow: look again
            else:
                if tail.events[-1].state in TERMINAL:
                    return
                try:
                    await asyncio.wait_for(tail.changed.wait(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    return
