"""One run's record: its state, step, weight version, ledger and event log, in memory and on disk.

The record is what the API shows (GetRun, ListRuns, WatchRun) and what a
restarted coordinator reloads: run.json (rewritten on change) and
events.jsonl (appended, the record of what happened). Event sequence numbers
are positions in the log, so a reloaded run's new events continue them.

It is not a blackboard: its fields are read-only views, and it changes only
through its commands, each of which announces itself. The loop counts
trajectories (`count_generated`, `drop`), records steps (`record_step`),
rewinds to a checkpoint (`rewind`) and finishes (`finish`); the run manager
changes its state (`set_state`, `end`) and queues resumes (`resume`). So the
ledger in run.json always agrees with what the events announced.
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
# A PAUSED run has ended for now (its watchers stop, it holds no slot) and resumes from its checkpoint.
TERMINAL = frozenset({pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED, pb.RUN_STATE_PAUSED})
STATE_NAMES = {v: pb.RunState.Name(v).removeprefix("RUN_STATE_").lower() for v in pb.RunState.values()}
_STATES = {name: value for value, name in STATE_NAMES.items()}
_KIND_NAMES = {v: pb.EventKind.Name(v).removeprefix("EVENT_KIND_").lower() for v in pb.EventKind.values()}
_KINDS = {name: value for value, name in _KIND_NAMES.items()}


class RunPaused(Exception):
    """The loop stopped the run resumably (a checkpoint holds the step it stopped at); the message says why."""


# The owner of a run recorded before runs had owners: the principal of the single `token` file.
LEGACY_OWNER = LEGACY_USER


class Run:
    def __init__(self, run_id: str, spec: RunSpec, run_dir: Path, owner: str = LEGACY_OWNER, kind: str = "loop"):
        self.run_id, self.run_dir = run_id, run_dir
        # The principal that submitted it (by name): only they and admins see it, and their quotas count it.
        self.owner = owner
        # "loop": rlserve's loop runs it; "tinker": a Tinker model its user drives call by call (rlserve.tinker).
        self.kind = kind
        self._spec = spec
        self._state = pb.RUN_STATE_QUEUED
        self._step = 0
        self._version = 0
        self._error = ""
        self._ledger = Ledger()
        self.usage = Usage()  # what its steps spent (`rlserve.runs.usage`)
        self._last_metrics: dict[str, float] = {}
        self.created = self.updated = time.time()
        self._final_model_path = ""
        self._plot_path = ""
        self._events: list[pb.RunEvent] | None = []
        self._changed = asyncio.Condition()
        self.recorder = Recorder(run_dir, spec.logger.tensorboard_enabled)
        # Non-empty: the next start continues from the last checkpoint, and this says why.
        self._resume_reason = ""

    # --- read-only views -------------------------------------------------------

    @property
    def spec(self) -> RunSpec:
        return self._spec

    @property
    def state(self) -> int:
        return self._state

    @property
    def error(self) -> str:
        return self._error

    @property
    def step(self) -> int:
        """Steps finished (trained or skipped)."""
        return self._step

    @property
    def version(self) -> int:
        """The policy's weight version after the last step."""
        return self._version

    @property
    def ledger(self) -> Ledger:
        """Where its trajectories went; change it only through the commands below."""
        return self._ledger

    @property
    def last_metrics(self) -> dict[str, float]:
        return dict(self._last_metrics)

    @property
    def final_model_path(self) -> str:
        return self._final_model_path

    @property
    def plot_path(self) -> str:
        return self._plot_path

    @property
    def resume_reason(self) -> str:
        """Non-empty: the next start continues from the last checkpoint, and this says why."""
        return self._resume_reason

    # --- the loop's commands ---------------------------------------------------

    def count_generated(self, n: int) -> None:
        """`n` trajectories (or examples) generated and in flight until trained or dropped."""
        self._ledger.generate(n)

    def drop(self, reason: str, n: int, message: str) -> None:
        """`n` in-flight trajectories dropped for `reason`, announced by a DROPPED event saying `message`."""
        self._ledger.drop(reason, n)
        self.emit(pb.EVENT_KIND_DROPPED, message, {f"dropped/{reason}": float(n)})

    def record_step(self, step: int, version: int, metrics: dict[str, float]) -> None:
        """Step `step` finished at weight version `version`: its metrics are written and its
        `batch/trajectories_trained` count as trained, together with the STEP event that announces them."""
        self._step, self._version = step, version
        self._last_metrics = {k: v for k, v in metrics.items() if isinstance(v, float)}
        self.recorder.metrics(step, metrics)
        self._ledger.train(int(metrics["batch/trajectories_trained"]))
        self.emit(pb.EVENT_KIND_STEP, f"step {step}/{self._spec.max_num_steps}", metrics)

    def record_primitive_step(self, version: int, metrics: dict[str, float]) -> None:
        """An optimizer step its user asked for (a Tinker model's optim_step) reached weight version `version`;
        `metrics` holds what the calls since the last step spent (`usage/*`), announced by its STEP event."""
        self._step, self._version = self._step + 1, version
        self._last_metrics = dict(metrics)
        self.recorder.metrics(self._step, metrics)
        self.emit(pb.EVENT_KIND_STEP, f"optim_step {self._step}", metrics)
        self.save()

    def rewind(self, checkpoint: Ledger, step: int, version: int, metrics_through: int) -> dict[str, float]:
        """Back to a checkpoint's ledger, step and version (metrics after step `metrics_through` are
        forgotten); returns the ledger's changes and `recovery/steps_redone` for the RECOVERED event."""
        ledger, changes = self._ledger.rewind(checkpoint)
        changes["recovery/steps_redone"] = float(max(0, self._step - step))
        self._ledger, self._step, self._version = ledger, step, version
        self.recorder.rewind(metrics_through)
        rows = self.recorder.read("metrics.jsonl")
        self._last_metrics = {k: v for k, v in rows[-1].items() if k != "step" and isinstance(v, float)} if rows \
            else {}
        self.save()
        return changes

    def finish(self, final_model_path: str, plot_path: str) -> None:
        """The run's outputs: the final policy's HF folder and the reward plot ("" when none)."""
        self._final_model_path, self._plot_path = final_model_path, plot_path
        self.save()

    # --- the run manager's commands ----------------------------------------------

    def resume(self, reason: str, spec: RunSpec | None = None) -> None:
        """The next start continues from the last checkpoint (with `spec`: a resume that extends the run)."""
        self._resume_reason = reason
        if spec is not None:
            self._spec = spec

    def take_resume_reason(self) -> str:
        """Why this start resumes ("" for a fresh start); the next start is a fresh one unless resumed again."""
        reason, self._resume_reason = self._resume_reason, ""
        return reason

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
        """Change state (detail: why a run failed, was cancelled or paused; it becomes `error`)."""
        self._state = state
        self._error = detail if state in (pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED, pb.RUN_STATE_PAUSED) else ""
        self.save()
        self.emit(pb.EVENT_KIND_STATE, STATE_NAMES[state] + (f": {detail}" if detail else ""))

    def end(self, state: int, detail: str = "", reason: str = "") -> None:
        """Enter a terminal state; what is still in flight is dropped with `reason` first."""
        n = self._ledger.in_flight
        if n and reason:
            self.drop(reason, n, f"dropped {n} trajectories in flight: {reason}")
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
        run = cls(info["run_id"], load_spec((run_dir / "spec.yaml").read_text()), run_dir, owner, info.get("kind", "loop"))
        run._state = _STATES[info["state"]]
        run._version, run._error = info["weight_version"], info["error"]
        run.created, run.updated = info["created"], info["updated"]
        run._final_model_path, run._plot_path = info["final_model_path"], info["plot_path"]
        run._last_metrics = info.get("last_metrics", {})
        run._load_events()
        # run.json may lag the event log (see `Ledger.as_announced`): the events are the record.
        run._ledger = Ledger.from_dict(info["ledger"]).as_announced(run.events)
        run.usage = Usage.from_events(run.events)
        run._step = next((ev.step for ev in reversed(run.events)
                          if ev.kind in (pb.EVENT_KIND_STEP, pb.EVENT_KIND_RECOVERED)), info["step"])
        return run

    def save(self) -> None:
        self.updated = time.time()
        self.recorder.write_json("run.json", {
            "run_id": self.run_id, "name": self.spec.name, "state": STATE_NAMES[self.state], "step": self.step,
            "weight_version": self.version, "error": self.error, "ledger": self.ledger.to_dict(),
            "created": self.created, "updated": self.updated, "final_model_path": self.final_model_path,
            "plot_path": self.plot_path, "last_metrics": self.last_metrics,
            "owner": self.owner, "usage": self.usage.to_dict(), "kind": self.kind})
