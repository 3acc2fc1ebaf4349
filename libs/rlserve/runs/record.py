"""One run's record: its state, step, weight version, ledger and event log, in memory and on disk.

The record is what the API shows (GetRun, ListRuns, WatchRun) and what a
restarted coordinator reloads: run.json (rewritten on change) and
events.jsonl (appended, the record of what happened). The RL loop writes
it; the run manager changes its state. Event sequence numbers are positions
in the log, so a reloaded run's new events continue them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from rlserve.config import RunSpec, load_spec
from rlserve.logs import event
from rlserve.runs.ledger import Ledger
from rlserve.runs.recorder import Recorder
from rlserve.runs.usage import Usage
from rlserve.security.principal import LEGACY_USER
from rlserve.v1 import coordinator_pb2 as pb

log = logging.getLogger("rlserve.coordinator")
TERMINAL = frozenset({pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED})
STATE_NAMES = {v: pb.RunState.Name(v).removeprefix("RUN_STATE_").lower() for v in pb.RunState.values()}
_STATES = {name: value for value, name in STATE_NAMES.items()}
_KIND_NAMES = {v: pb.EventKind.Name(v).removeprefix("EVENT_KIND_").lower() for v in pb.EventKind.values()}
_KINDS = {name: value for value, name in _KIND_NAMES.items()}
# The owner of a run recorded before runs had owners: the principal of the single `token` file.
LEGACY_OWNER = LEGACY_USER


class Run:
    def __init__(self, run_id: str, spec: RunSpec, run_dir: Path, owner: str = LEGACY_OWNER):
        self.run_id, self.spec, self.run_dir = run_id, spec, run_dir
        # The principal that submitted it (by name): only they and admins see it, and their quotas count it.
        self.owner = owner
        self.state = pb.RUN_STATE_QUEUED
        self.step = 0
        self.version = 0
        self.error = ""
        self.ledger = Ledger()
        self.usage = Usage()  # what its steps spent (`rlserve.runs.usage`)
        self.last_metrics: dict[str, float] = {}
        self.created = self.updated = time.time()
        self.final_model_path = ""
        self.plot_path = ""
        self._events: list[pb.RunEvent] | None = []
        self._changed = asyncio.Condition()
        self.recorder = Recorder(run_dir, spec.logger.tensorboard_enabled)
        # Non-empty: the next start continues from the last checkpoint, and this says why.
        self.resume_reason = ""

    # --- events --------------------------------------------------------------

    @property
    def events(self) -> list[pb.RunEvent]:
        """Every event so far (read back from events.jsonl when `forget_events` let them go)."""
        if self._events is None:
            self._load_events()
        return self._events

    def forget_events(self) -> None:
        """Drop the in-memory copy of a finished run's events (they are on disk): a coordinator that has run
        hundreds of runs keeps their records, not their histories."""
        if self.state in TERMINAL:
            self._events = None

    def emit(self, kind: int, message: str, metrics: dict[str, float] | None = None, step: int | None = None) -> None:
        ev = pb.RunEvent(sequence=len(self.events), time_unix=time.time(), run_id=self.run_id,
                         step=self.step if step is None else step, kind=kind, message=message,
                         metrics=metrics or {}, state=self.state)
        self.events.append(ev)
        self.updated = ev.time_unix
        self.usage.add_step(ev.metrics)
        self.recorder.append("events.jsonl", {"seq": ev.sequence, "time": ev.time_unix, "step": ev.step,
                                              "kind": _KIND_NAMES[kind], "state": STATE_NAMES[self.state],
                                              "message": message, "metrics": dict(ev.metrics)})
        if kind != pb.EVENT_KIND_STEP:
            event(log, "run.event", run=self.run_id, step=ev.step, kind=_KIND_NAMES[kind], message=message)
        self._notify()

    def _load_events(self) -> None:
        """events.jsonl as written by `emit`; sequence numbers are positions, so new events continue them."""
        self._events = [pb.RunEvent(sequence=i, time_unix=r["time"], run_id=self.run_id, step=r["step"],
                                   kind=_KINDS.get(r["kind"], pb.EVENT_KIND_UNSPECIFIED), message=r["message"],
                                   metrics=r["metrics"], state=_STATES.get(r.get("state", ""), 0))
                       for i, r in enumerate(self.recorder.read("events.jsonl"))]

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()
        try:
            asyncio.get_running_loop().create_task(wake())
        except RuntimeError:
            pass  # no event loop: nobody can be watching

    def set_state(self, state: int, detail: str = "") -> None:
        """Change state (detail: why a run failed or was cancelled; it becomes `error`)."""
        self.state = state
        self.error = detail if state in (pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED) else ""
        self.save()
        self.emit(pb.EVENT_KIND_STATE, STATE_NAMES[state] + (f": {detail}" if detail else ""))

    def end(self, state: int, detail: str = "", reason: str = "") -> None:
        """Enter a terminal state; what is still in flight is dropped with `reason` first."""
        n = self.ledger.in_flight
        if n and reason:
            self.ledger.drop(reason, n)
            self.emit(pb.EVENT_KIND_DROPPED, f"dropped {n} trajectories in flight: {reason}",
                      {f"dropped/{reason}": float(n)})
        self.set_state(state, detail)

    async def watch(self, from_sequence: int, max_s: float) -> AsyncIterator[pb.RunEvent]:
        """Events from `from_sequence` on, until the run ends or `max_s` pass (the caller then continues
        from the next sequence number: a stream never holds the service for good)."""
        seq = from_sequence
        deadline = time.monotonic() + max_s
        while True:
            async with self._changed:
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: len(self.events) > seq or self.state in TERMINAL),
                        max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    return
            while seq < len(self.events):
                yield self.events[seq]
                seq += 1
            if self.state in TERMINAL and seq >= len(self.events):
                return

    # --- state ---------------------------------------------------------------

    def to_proto(self) -> pb.Run:
        return pb.Run(run_id=self.run_id, name=self.spec.name, state=self.state, step=self.step,
                      max_steps=self.spec.max_num_steps, weight_version=self.version, run_dir=str(self.run_dir),
                      error=self.error, ledger=self.ledger.to_proto(), last_metrics=self.last_metrics,
                      created_unix=self.created, updated_unix=self.updated,
                      final_model_path=self.final_model_path, plot_path=self.plot_path,
                      owner=self.owner, usage=self.usage.to_proto())

    @classmethod
    def from_disk(cls, run_dir: Path) -> Run:
        """A run of an earlier coordinator, as its run.json and events.jsonl left it."""
        info = json.loads((run_dir / "run.json").read_text())
        owner = info.get("owner", LEGACY_OWNER)
        if not isinstance(owner, str):
            raise ValueError(f"owner: {owner!r} is not a principal's name")
        run = cls(info["run_id"], load_spec((run_dir / "spec.yaml").read_text()), run_dir, owner)
        run.state = _STATES[info["state"]]
        run.step, run.version, run.error = info["step"], info["weight_version"], info["error"]
        run.created, run.updated = info["created"], info["updated"]
        run.final_model_path, run.plot_path = info["final_model_path"], info["plot_path"]
        run.last_metrics = info.get("last_metrics", {})
        run._load_events()
        # run.json may lag the event log (see `Ledger.as_announced`): the events are the record.
        run.ledger = Ledger.from_dict(info["ledger"]).as_announced(run.events)
        run.usage = Usage.from_events(run.events)
        run.step = next((ev.step for ev in reversed(run.events)
                         if ev.kind in (pb.EVENT_KIND_STEP, pb.EVENT_KIND_RECOVERED)), run.step)
        return run

    def save(self) -> None:
        self.updated = time.time()
        self.recorder.write_json("run.json", {
            "run_id": self.run_id, "name": self.spec.name, "state": STATE_NAMES[self.state], "step": self.step,
            "weight_version": self.version, "error": self.error, "ledger": self.ledger.to_dict(),
            "created": self.created, "updated": self.updated, "final_model_path": self.final_model_path,
            "plot_path": self.plot_path, "last_metrics": self.last_metrics,
            "owner": self.owner, "usage": self.usage.to_dict()})
