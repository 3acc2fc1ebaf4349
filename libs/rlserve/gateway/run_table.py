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
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.message import Message

from rlserve.security.principal import SYSTEM, Principal
from rlserve.v1 import coordinator_pb2 as pb


class RunTable:
    def __init__(self) -> None:
        self._runs: dict[str, pb.Run] = {}
        self._seen: dict[str, float] = {}  # run id -> the newest event time passed on for it
        self.live = False

    def replace(self, records: Iterable[bytes]) -> None:
        """A feed's first batch: every run the coordinator has. A record this gateway learned since the batch
        was made (a write's answer) stays, being newer."""
        runs = [pb.Run.FromString(data) for data in records]
        kept = {run.run_id for run in runs}
        self._runs = {run_id: run for run_id, run in self._runs.items() if run_id in kept}
        self._merge(runs)
        self.live = True

    def update(self, records: Iterable[bytes]) -> None:
        """A later batch of the feed: the runs that changed."""
        self._merge(pb.Run.FromString(data) for data in records)

    def down(self) -> None:
        """The feed ended: until the next feed's first batch, every read is forwarded."""
        self.live = False
        self._runs = {}

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
