"""The gateway's copy of the coordinator's runs: GetRun and ListRuns answered without a Serve hop.

The coordinator's feed (`rlserve.runs.feed`) sends every run once and then
each change. A read the copy can answer exactly is answered here; any other is
forwarded to the coordinator as before, which keeps the coordinator the only
judge of what a caller may see that is not in the copy:

- no copy while the feed is down (the coordinator restarting): forwarded;
- a run id not in the copy, or one the caller may not see: forwarded (the
  coordinator answers NOT_FOUND alike for both, or the run is newer than the copy);
- a run the copy holds older than what this gateway already passed on: forwarded.

The last point keeps what a caller saw in order. Every forwarded answer that
carries runs (SubmitRun, CancelRun, GetRun, ListRuns) updates the copy, so a
caller reads its own writes at once. Each WatchRun event that passes through
records its time: the copy answers for that run only once it holds the run at
least as new (`updated_unix` is the time of the run's last event or save),
so a client that saw a run end in its stream reads it ended. An update never
replaces a newer record with an older one.

The feed's events of unfinished runs go to `events` (`rlserve.gateway.run_events`), from which a
WatchRun the caller may see is served, under the same rules.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from google.protobuf.message import Message

from rlserve.gateway.run_events import RunEvents
from rlserve.runs.feed import FeedBatch
from rlserve.security.principal import SYSTEM, Principal
from rlserve.v1 import coordinator_pb2 as pb


class RunTable:
    def __init__(self) -> None:
        self._runs: dict[str, pb.Run] = {}
        self._seen: dict[str, float] = {}  # run id -> the newest event time passed on for it
        self.events = RunEvents()
        self.live = False

    def replace(self, batch: FeedBatch) -> None:
        """A feed's first batch: every run the coordinator has, and the newest events of the unfinished ones.
        A record this gateway learned since the batch was made (a write's answer) stays, being newer."""
        runs = [pb.Run.FromString(data) for data in batch.runs]
        kept = {run.run_id for run in runs}
        self._runs = {run_id: run for run_id, run in self._runs.items() if run_id in kept}
        self._merge(runs)
        events = [pb.RunEvent.FromString(data) for data in batch.events]
        self.events.keep_only({ev.run_id for ev in events})
        self.events.add(events)
        self.live = True

    def update(self, batch: FeedBatch) -> None:
        """A later batch of the feed: the runs that changed, and the unfinished runs' new events."""
        self._merge(pb.Run.FromString(data) for data in batch.runs)
        self.events.add(pb.RunEvent.FromString(data) for data in batch.events)

    def down(self) -> None:
        """The feed ended: until the next feed's first batch, every read is forwarded, and every watcher
        served here continues forwarded."""
        self.live = False
        self._runs = {}
        self.events.keep_only(set())

    def answer(self, method: str, request: Message, caller: Principal | None) -> Message | None:
        """The response to a GetRun or ListRuns the copy can answer exactly; None: forward it."""
        if not self.live:
            return None
        who = caller or SYSTEM  # no authentication: the coordinator acts as the cluster itself
        if method == "GetRun":
            run = self._runs.get(request.run_id)
            if run is None or not who.may_access(run.owner) or not self._fresh(run):
                return None
            return pb.GetRunResponse(run=run)
        if method == "ListRuns":
            runs = [run for run in self._runs.values() if who.may_access(run.owner)]
            if not all(self._fresh(run) for run in runs):
                return None
            return pb.ListRunsResponse(runs=runs)
        return None

    def watch(self, request: pb.WatchRunRequest, caller: Principal | None, max_s: float
              ) -> AsyncIterator[pb.RunEvent] | None:
        """The events of a WatchRun the copy can serve (`RunEvents.follow`); None: forward it."""
        run = self._runs.get(request.run_id) if self.live else None
        if (run is None or not (caller or SYSTEM).may_access(run.owner)
                or not self.events.holds(run.run_id, request.from_sequence)):
            return None
        return self.events.follow(run.run_id, request.from_sequence, max_s)

    def learn(self, response: Message) -> None:
        """A forwarded answer: the runs it carries are what the coordinator holds now."""
        if isinstance(response, pb.ListRunsResponse):
            self._merge(response.runs)
        elif isinstance(response, (pb.GetRunResponse, pb.SubmitRunResponse, pb.CancelRunResponse)):
            self._merge([response.run])
        elif isinstance(response, pb.WatchRunResponse):
            ev = response.event
            self._seen[ev.run_id] = max(self._seen.get(ev.run_id, 0.0), ev.time_unix)

    def _merge(self, runs: Iterable[pb.Run]) -> None:
        for run in runs:
            held = self._runs.get(run.run_id)
            if held is None or run.updated_unix >= held.updated_unix:
                self._runs[run.run_id] = run

    def _fresh(self, run: pb.Run) -> bool:
        return run.updated_unix >= self._seen.get(run.run_id, 0.0)
