"""Runs: their state, their event log, and the queue that runs them one at a time.

The rollout and learner services hold one policy at a time, so runs are
queued and run in submission order (`max_concurrent_runs`, default 1). A run
lives in memory while the coordinator is up and in its run directory on disk
(run.json, events.jsonl) across restarts. A coordinator that starts reloads
every run with its events (sequence numbers continue); a run that was running
resumes from its last checkpoint by itself (`checkpointing.auto_resume`,
unless the cluster file sets the coordinator's `resume_on_restart: false`,
in which case it is marked FAILED with the command that resumes it).

A submitted run is QUEUED at once; its preflight (checks that need the model
or the data) runs beside the queue, and a run starts only after its
preflight passed. Run ids name folders in the runs directory, so a new id
and a resumed one are checked alike; a run that SUCCEEDED or was CANCELLED
is resumed only to extend it (a larger `grpo.max_num_steps`).

States: QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLING -> CANCELLED.
A run that ends has a balanced ledger: what was in flight when it failed or
was cancelled is dropped with reason `failed` or `cancelled`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from rlserve.config import RunSpec, SpecError, load_spec, spec_to_yaml
from rlserve.logs import event
from rlserve.rpc import RpcError, already_exists, clean, failed_precondition, invalid_argument, not_found
from rlserve.v1 import coordinator_pb2 as pb
from services.coordinator.ledger import Ledger
from services.coordinator.recorder import Recorder

log = logging.getLogger("rlserve.coordinator")
TERMINAL = {pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED}
# A run id is a folder name inside the runs directory: no separators, no '..', not hidden.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_STATE_NAMES = {v: pb.RunState.Name(v).removeprefix("RUN_STATE_").lower() for v in pb.RunState.values()}
_STATES = {name: value for value, name in _STATE_NAMES.items()}
_KIND_NAMES = {v: pb.EventKind.Name(v).removeprefix("EVENT_KIND_").lower() for v in pb.EventKind.values()}
_KINDS = {name: value for value, name in _KIND_NAMES.items()}


class Run:
    def __init__(self, run_id: str, spec: RunSpec, run_dir: Path):
        self.run_id, self.spec, self.run_dir = run_id, spec, run_dir
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
        # Non-empty: the next start continues from the last checkpoint, and this says why.
        self.resume_reason = ""
        self.cancel_requested = False
        self.preflight: asyncio.Task | None = None
        self.preflight_passed = False

    # --- events --------------------------------------------------------------

    def emit(self, kind: int, message: str, metrics: dict[str, float] | None = None, step: int | None = None) -> None:
        ev = pb.RunEvent(sequence=len(self.events), time_unix=time.time(), run_id=self.run_id,
                         step=self.step if step is None else step, kind=kind, message=message,
                         metrics=metrics or {}, state=self.state)
        self.events.append(ev)
        self.updated = ev.time_unix
        self.recorder.append("events.jsonl", {"seq": ev.sequence, "time": ev.time_unix, "step": ev.step,
                                              "kind": _KIND_NAMES[kind], "state": _STATE_NAMES[self.state],
                                              "message": message, "metrics": dict(ev.metrics)})
        if kind != pb.EVENT_KIND_STEP:
            event(log, "run.event", run=self.run_id, step=ev.step, kind=_KIND_NAMES[kind], message=message)
        self._notify()

    def _load_events(self) -> None:
        """events.jsonl as written by `emit`; sequence numbers are positions, so new events continue them."""
        self.events = [pb.RunEvent(sequence=i, time_unix=r["time"], run_id=self.run_id, step=r["step"],
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
        self.emit(pb.EVENT_KIND_STATE, _STATE_NAMES[state] + (f": {detail}" if detail else ""))

    def end(self, state: int, detail: str = "", reason: str = "") -> None:
        """Enter a terminal state; what is still in flight is dropped with `reason` first."""
        n = self.ledger.in_flight
        if n and reason:
            self.ledger.drop(reason, n)
            self.emit(pb.EVENT_KIND_DROPPED, f"dropped {n} trajectories in flight: {reason}",
                      {f"dropped/{reason}": float(n)})
        self.set_state(state, detail)

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
        """A run of an earlier coordinator, as its run.json and events.jsonl left it."""
        info = json.loads((run_dir / "run.json").read_text())
        run = cls(info["run_id"], load_spec((run_dir / "spec.yaml").read_text()), run_dir)
        run.state = _STATES[info["state"]]
        run.step, run.version, run.error = info["step"], info["weight_version"], info["error"]
        run.ledger = Ledger.from_dict(info["ledger"])
        run.created, run.updated = info["created"], info["updated"]
        run.final_model_path, run.plot_path = info["final_model_path"], info["plot_path"]
        run.last_metrics = info.get("last_metrics", {})
        run._load_events()
        return run

    def save(self) -> None:
        self.updated = time.time()
        self.recorder.write_json("run.json", {
            "run_id": self.run_id, "name": self.spec.name, "state": _STATE_NAMES[self.state], "step": self.step,
            "weight_version": self.version, "error": self.error, "ledger": self.ledger.to_dict(),
            "created": self.created, "updated": self.updated, "final_model_path": self.final_model_path,
            "plot_path": self.plot_path, "last_metrics": self.last_metrics})


RunBody = Callable[[Run], Awaitable[None]]


def check_run_id(run_id: str) -> None:
    if not _RUN_ID.fullmatch(run_id):
        shown = run_id if len(run_id) <= 80 else run_id[:80] + "..."
        raise invalid_argument("run_id", f"{shown!r}: 1-128 letters, digits, '-', '_' or '.', starting with a "
                                         f"letter or digit")


class RunManager:
    def __init__(self, runs_dir: Path, body: RunBody, check: Callable[[RunSpec], Awaitable[RunSpec]],
                 preflight: Callable[[RunSpec], Awaitable[None]], preflight_timeout_s: float,
                 max_concurrent_runs: int = 1, resume_on_restart: bool = True):
        """`check` runs in the request (cheap; returns the spec with confined paths); `preflight` after it."""
        self.runs_dir = runs_dir
        self.body = body
        self.check = check
        self.preflight = preflight
        self.preflight_timeout_s = preflight_timeout_s
        self.max_concurrent = max_concurrent_runs
        self.resume_on_restart = resume_on_restart
        self.runs: dict[str, Run] = {}
        self.queue: list[str] = []
        self.closing = False
        runs_dir.mkdir(parents=True, exist_ok=True)
        self._load_earlier_runs()

    def _load_earlier_runs(self) -> None:
        """Runs of earlier coordinators stay visible with their events; those it left active continue."""
        for path in sorted(self.runs_dir.glob("*/run.json")):
            try:
                run = Run.from_disk(path.parent)
                run.to_proto()  # a run whose record does not fit the API is skipped, not every ListRuns
            except (KeyError, TypeError, ValueError, SpecError, OSError) as err:
                log.warning("skipping run directory %s: %s", path.parent, err)
                continue
            self.runs[run.run_id] = run
        active = sorted((r for r in self.runs.values() if r.state not in TERMINAL),
                        key=lambda r: (r.state != pb.RUN_STATE_RUNNING, r.created))
        for run in active:
            was = _STATE_NAMES[run.state]
            if run.state == pb.RUN_STATE_CANCELLING:
                run.end(pb.RUN_STATE_CANCELLED, "the coordinator restarted while the run was cancelling",
                        reason="cancelled")
            elif self.resume_on_restart and run.spec.checkpointing.auto_resume:
                run.resume_reason = f"the coordinator restarted while the run was {was}"
                run.emit(pb.EVENT_KIND_INFO, f"{run.resume_reason}; it continues from its last checkpoint")
                run.preflight_passed = True  # it passed when it was submitted
                self.queue.append(run.run_id)
            else:
                why = ("checkpointing.auto_resume is off" if self.resume_on_restart
                       else "the coordinator's resume_on_restart is off")
                run.end(pb.RUN_STATE_FAILED, f"the coordinator stopped while the run was {was} ({why}); resume "
                        f"with `rlserve submit --resume {run.run_id}`", reason="failed")
        if self.queue:
            self._schedule()

    def _load_spec(self, spec_yaml: str) -> RunSpec:
        try:
            return load_spec(spec_yaml)
        except SpecError as err:
            raise invalid_argument(f"spec_yaml: {err.first_path}", "; ".join(err.problems)) from None

    async def _resumed_spec(self, run_id: str, spec_yaml: str) -> RunSpec:
        """The stored spec; with `spec_yaml`, that spec, which may differ only in grpo.max_num_steps.

        A run that SUCCEEDED or was CANCELLED is resumed only when the request asks to extend it: a spec
        whose grpo.max_num_steps is larger than the steps it did.
        """
        run_dir = self.runs_dir / run_id
        if not (run_dir / "spec.yaml").is_file():
            raise not_found(f"run {run_id!r} has no run directory in {self.runs_dir}")
        earlier = self.runs.get(run_id)
        if earlier is not None and earlier.state not in TERMINAL:
            raise failed_precondition(f"run {run_id!r} is {_STATE_NAMES[earlier.state]}")
        stored = await self.check(self._load_spec((run_dir / "spec.yaml").read_text()))
        spec = stored
        if spec_yaml.strip():
            spec = await self.check(self._load_spec(spec_yaml))
            mine, theirs = stored.model_dump(mode="json"), spec.model_dump(mode="json")
            mine["grpo"].pop("max_num_steps")
            theirs["grpo"].pop("max_num_steps")
            if mine != theirs:
                raise invalid_argument("spec_yaml", "when resuming, only grpo.max_num_steps may change")
        if earlier is not None and earlier.state in (pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_CANCELLED) and (
                not spec_yaml.strip() or spec.grpo.max_num_steps <= earlier.step):
            raise failed_precondition(
                f"run {run_id!r} {_STATE_NAMES[earlier.state]} at step {earlier.step}; to continue it, resume "
                f"with a spec whose grpo.max_num_steps is larger than {earlier.step}")
        return spec

    async def submit(self, spec_yaml: str, run_id: str, resume: bool) -> Run:
        if resume and not run_id:
            raise invalid_argument("run_id", "required with resume")
        if run_id:
            check_run_id(run_id)
        if resume:
            spec = await self._resumed_spec(run_id, spec_yaml)
        else:
            spec = self._load_spec(spec_yaml)
            if run_id and (run_id in self.runs or (self.runs_dir / run_id).exists()):
                raise already_exists(f"run {run_id!r} exists")
            run_id = run_id or f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
            # Files confined to the cluster's directories, plug-ins and reward servers allow-listed.
            spec = await self.check(spec)
        run_dir = self.runs_dir / run_id
        # A resumed run keeps its history (events, ledger, step) until its checkpoint is restored.
        run = self.runs.get(run_id) if resume else None
        run = run or Run(run_id, spec, run_dir)
        run.spec = spec
        run.preflight_passed = False
        if resume:
            run.resume_reason = "resumed by SubmitRun"
        (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
        self.runs[run_id] = run
        self.queue.append(run_id)
        run.set_state(pb.RUN_STATE_QUEUED)
        run.preflight = asyncio.get_running_loop().create_task(self._preflight(run))
        return run

    async def _preflight(self, run: Run) -> None:
        run.emit(pb.EVENT_KIND_INFO, "preflight: checking the model, the data and the reward functions")
        try:
            await asyncio.wait_for(self.preflight(run.spec), self.preflight_timeout_s)
        except asyncio.TimeoutError:
            self._fail_queued(run, f"preflight: not done within {self.preflight_timeout_s:.0f}s (model, data set "
                                   f"or a service too slow)")
        except RpcError as err:
            self._fail_queued(run, f"preflight: {err.code.name}: {err.message}")
        except Exception as err:  # noqa: BLE001 - a preflight failure is the run's, never the coordinator's
            log.exception("preflight of run %s failed", run.run_id)
            self._fail_queued(run, f"preflight: {clean(f'{type(err).__name__}: {err}')}")
        else:
            if run.state == pb.RUN_STATE_QUEUED:
                run.preflight_passed = True
                run.emit(pb.EVENT_KIND_INFO, "preflight passed")
        finally:
            self._schedule()

    def _fail_queued(self, run: Run, message: str) -> None:
        if run.state != pb.RUN_STATE_QUEUED:
            return  # cancelled meanwhile
        if run.run_id in self.queue:
            self.queue.remove(run.run_id)
        run.emit(pb.EVENT_KIND_ERROR, message)
        run.end(pb.RUN_STATE_FAILED, message, reason="failed")
        run.recorder.close()

    def list_protos(self) -> list[pb.Run]:
        protos = []
        for run in self.runs.values():
            try:
                protos.append(run.to_proto())
            except (ValueError, TypeError) as err:  # one bad record must not hide the others
                log.warning("run %s cannot be listed: %s", run.run_id, err)
        return protos

    def get(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise not_found(f"run {run_id!r}")
        return run

    def cancel(self, run_id: str) -> Run:
        """A queued run is cancelled at once; a running one becomes CANCELLING until its tasks stop."""
        run = self.get(run_id)
        if run.state in TERMINAL or run.state == pb.RUN_STATE_CANCELLING:
            return run
        if run_id in self.queue:
            self.queue.remove(run_id)
            if run.preflight is not None:
                run.preflight.cancel()
            run.end(pb.RUN_STATE_CANCELLED, "by CancelRun before it started", reason="cancelled")
        elif run.task is not None:
            run.cancel_requested = True
            run.set_state(pb.RUN_STATE_CANCELLING, f"by CancelRun at step {run.step}")
            run.task.cancel()
        return run

    async def shutdown(self) -> None:
        """The coordinator is going away: stop every run's task, leaving the runs as they are on disk."""
        self.closing = True
        tasks = [r.task for r in self.runs.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _active(self) -> int:
        return sum(1 for r in self.runs.values() if r.task is not None and not r.task.done() and r.state not in TERMINAL)

    def _schedule(self) -> None:
        """Start queued runs in submission order; the head waits until its preflight passed."""
        while self.queue and self._active() < self.max_concurrent and not self.closing:
            if not self.runs[self.queue[0]].preflight_passed:
                return  # its preflight calls _schedule when it ends (and takes it off the queue if it fails)
            run = self.runs[self.queue.pop(0)]
            run.cancel_requested = False
            run.set_state(pb.RUN_STATE_RUNNING)
            run.task = asyncio.get_running_loop().create_task(self._execute(run))

    async def _execute(self, run: Run) -> None:
        try:
            await self.body(run)
            run.end(pb.RUN_STATE_SUCCEEDED)
        except asyncio.CancelledError:
            if not run.cancel_requested:
                # The coordinator itself is going away: the run stays RUNNING on disk and the next
                # coordinator resumes it.
                raise
            run.end(pb.RUN_STATE_CANCELLED, f"by CancelRun at step {run.step}", reason="cancelled")
        except Exception as err:  # noqa: BLE001 - a run's failure is its state, never the coordinator's
            log.exception("run %s failed", run.run_id)
            message = clean(str(err)) or type(err).__name__  # no colour codes or tracebacks
            run.emit(pb.EVENT_KIND_ERROR, message)
            run.end(pb.RUN_STATE_FAILED, message, reason="failed")
        run.recorder.close()
        self._schedule()
