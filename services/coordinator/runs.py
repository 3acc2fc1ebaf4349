"""Runs: their state, their event log, and the queue that runs them one at a time.

The rollout and learner services hold one policy at a time, so runs are
queued and run in submission order (`max_concurrent_runs`, default 1). A run
lives in memory while the coordinator is up and in its run directory on disk
(run.json, events.jsonl) across restarts; a run that was running when the
coordinator went away is marked FAILED with a hint to resume it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from rlserve.config import RunSpec, SpecError, load_spec, spec_to_yaml
from rlserve.logs import event
from rlserve.rpc import already_exists, failed_precondition, invalid_argument, not_found
from rlserve.v1 import coordinator_pb2 as pb
from services.coordinator.ledger import Ledger
from services.coordinator.recorder import Recorder

log = logging.getLogger("rlserve.coordinator")
TERMINAL = {pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED}
_STATE_NAMES = {v: pb.RunState.Name(v).removeprefix("RUN_STATE_").lower() for v in pb.RunState.values()}


class Run:
    def __init__(self, run_id: str, spec: RunSpec, run_dir: Path, resume: bool = False):
        self.run_id, self.spec, self.run_dir, self.resume = run_id, spec, run_dir, resume
        self.state = pb.RUN_STATE_QUEUED
        self.step = 0
        self.version = 0
        self.error = ""
        self.ledger = Ledger()
        self.last_metrics: dict[str, float] = {}
        self.created = self.updated = time.time()
        self.final_model_path = ""
        self.plot_path = ""
        self.events: list[pb.RunEvent] = []
        self._changed = asyncio.Condition()
        self.recorder = Recorder(run_dir, spec.logger.tensorboard_enabled)
        self.task: asyncio.Task | None = None

    # --- events --------------------------------------------------------------

    def emit(self, kind: int, message: str, metrics: dict[str, float] | None = None, step: int | None = None) -> None:
        ev = pb.RunEvent(sequence=len(self.events), time_unix=time.time(), run_id=self.run_id,
                         step=self.step if step is None else step, kind=kind, message=message,
                         metrics=metrics or {}, state=self.state)
        self.events.append(ev)
        self.updated = ev.time_unix
        self.recorder.append("events.jsonl", {"seq": ev.sequence, "time": ev.time_unix, "step": ev.step,
                                              "kind": pb.EventKind.Name(kind).removeprefix("EVENT_KIND_").lower(),
                                              "message": message, "metrics": dict(ev.metrics)})
        if kind != pb.EVENT_KIND_STEP:
            event(log, "run.event", run=self.run_id, step=ev.step,
                  kind=pb.EventKind.Name(kind).removeprefix("EVENT_KIND_").lower(), message=message)
        self._notify()

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()
        asyncio.get_running_loop().create_task(wake())

    def set_state(self, state: int, error: str = "") -> None:
        self.state, self.error = state, error or self.error
        self.save()
        self.emit(pb.EVENT_KIND_STATE, f"{_STATE_NAMES[state]}" + (f": {error}" if error else ""))

    async def watch(self, from_sequence: int) -> AsyncIterator[pb.RunEvent]:
        seq = from_sequence
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self.events) > seq or self.state in TERMINAL)
            while seq < len(self.events):
                yield self.events[seq]
                seq += 1
            if self.state in TERMINAL and seq >= len(self.events):
                return

    # --- state ---------------------------------------------------------------

    def to_proto(self) -> pb.Run:
        return pb.Run(run_id=self.run_id, name=self.spec.name, state=self.state, step=self.step,
                      max_steps=self.spec.grpo.max_num_steps, weight_version=self.version, run_dir=str(self.run_dir),
                      error=self.error, ledger=self.ledger.to_proto(), last_metrics=self.last_metrics,
                      created_unix=self.created, updated_unix=self.updated,
                      final_model_path=self.final_model_path, plot_path=self.plot_path)

    @classmethod
    def from_disk(cls, run_dir: Path) -> Run:
        """A run of an earlier coordinator, as its run.json left it (for GetRun/ListRuns; resumable)."""
        info = json.loads((run_dir / "run.json").read_text())
        run = cls(info["run_id"], load_spec((run_dir / "spec.yaml").read_text()), run_dir)
        run.state = {name: value for value, name in _STATE_NAMES.items()}[info["state"]]
        run.step, run.version, run.error = info["step"], info["weight_version"], info["error"]
        run.ledger = Ledger.from_dict(info["ledger"])
        run.created, run.updated = info["created"], info["updated"]
        run.final_model_path, run.plot_path = info["final_model_path"], info["plot_path"]
        run.last_metrics = info.get("last_metrics", {})
        return run

    def save(self) -> None:
        self.updated = time.time()
        self.recorder.write_json("run.json", {
            "run_id": self.run_id, "name": self.spec.name, "state": _STATE_NAMES[self.state], "step": self.step,
            "weight_version": self.version, "error": self.error, "ledger": self.ledger.to_dict(),
            "created": self.created, "updated": self.updated, "final_model_path": self.final_model_path,
            "plot_path": self.plot_path, "last_metrics": self.last_metrics})


RunBody = Callable[[Run], Awaitable[None]]


class RunManager:
    def __init__(self, runs_dir: Path, body: RunBody, check: Callable[[RunSpec], Awaitable[RunSpec]],
                 max_concurrent_runs: int = 1):
        self.runs_dir = runs_dir
        self.body = body
        self.check = check
        self.max_concurrent = max_concurrent_runs
        self.runs: dict[str, Run] = {}
        self.queue: list[str] = []
        runs_dir.mkdir(parents=True, exist_ok=True)
        self._load_earlier_runs()

    def _load_earlier_runs(self) -> None:
        """Runs of earlier coordinators stay visible; those left running can be resumed by hand."""
        for path in sorted(self.runs_dir.glob("*/run.json")):
            info = json.loads(path.read_text())
            if info.get("state") in ("running", "queued"):
                info["state"] = "failed"
                info["error"] = (f"the coordinator stopped while the run was {info.get('state')}; resume with "
                                 f"`rlserve submit --resume {info['run_id']}`")
                path.write_text(json.dumps(info, indent=1) + "\n")
            try:
                self.runs[info["run_id"]] = Run.from_disk(path.parent)
            except (KeyError, ValueError, SpecError, OSError) as err:
                log.warning("skipping run directory %s: %s", path.parent, err)

    def _load_spec(self, spec_yaml: str) -> RunSpec:
        try:
            return load_spec(spec_yaml)
        except SpecError as err:
            raise invalid_argument(f"spec_yaml: {err.first_path}", "; ".join(err.problems)) from None

    async def submit(self, spec_yaml: str, run_id: str, resume: bool) -> Run:
        if resume:
            if not run_id:
                raise invalid_argument("run_id", "required with resume")
            run_dir = self.runs_dir / run_id
            if not (run_dir / "spec.yaml").is_file():
                raise not_found(f"run {run_id!r} has no run directory in {self.runs_dir}")
            if run_id in self.runs and self.runs[run_id].state not in TERMINAL:
                raise failed_precondition(f"run {run_id!r} is {_STATE_NAMES[self.runs[run_id].state]}")
            spec = self._load_spec((run_dir / "spec.yaml").read_text())
        else:
            spec = self._load_spec(spec_yaml)
            if run_id and (run_id in self.runs or (self.runs_dir / run_id).exists()):
                raise already_exists(f"run {run_id!r} exists")
            if run_id and not all(c.isalnum() or c in "-_." for c in run_id):
                raise invalid_argument("run_id", "letters, digits, '-', '_' and '.' only")
            run_id = run_id or f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
            run_dir = self.runs_dir / run_id
        spec = await self.check(spec)
        run = Run(run_id, spec, run_dir, resume=resume)
        if not resume:
            (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
        self.runs[run_id] = run
        self.queue.append(run_id)
        run.set_state(pb.RUN_STATE_QUEUED)
        self._schedule()
        return run

    def get(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise not_found(f"run {run_id!r}")
        return run

    def cancel(self, run_id: str) -> Run:
        run = self.get(run_id)
        if run.state in TERMINAL:
            return run
        if run_id in self.queue:
            self.queue.remove(run_id)
            run.set_state(pb.RUN_STATE_CANCELLED, "cancelled before it started")
        elif run.task is not None:
            run.task.cancel()
        return run

    def _running(self) -> int:
        return sum(1 for r in self.runs.values() if r.state == pb.RUN_STATE_RUNNING)

    def _schedule(self) -> None:
        while self.queue and self._running() < self.max_concurrent:
            run = self.runs[self.queue.pop(0)]
            run.set_state(pb.RUN_STATE_RUNNING)
            run.task = asyncio.get_running_loop().create_task(self._execute(run))

    async def _execute(self, run: Run) -> None:
        try:
            await self.body(run)
            run.set_state(pb.RUN_STATE_SUCCEEDED)
        except asyncio.CancelledError:
            run.set_state(pb.RUN_STATE_CANCELLED, "cancelled")
        except Exception as err:  # noqa: BLE001 - a run's failure is its state, never the coordinator's
            log.exception("run %s failed", run.run_id)
            message = str(err) or type(err).__name__
            run.emit(pb.EVENT_KIND_ERROR, message)
            run.set_state(pb.RUN_STATE_FAILED, message)
        finally:
            run.recorder.close()
            self._schedule()
