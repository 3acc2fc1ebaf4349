"""The runs of a coordinator: submission, the queue, preflight, cancellation and restart.

Runs are queued and start in submission order. A run that trains a LoRA
adapter on the deployed base (`RunSpec.shares_deployed_base`) shares the
rollout engines (its adapter beside the others') and the learner's workers
(one frozen base): up to `tenancy.cluster.max_training_runs` such runs train at
once. Any other run (full-parameter, or LoRA on its own base) needs the policy engines
alone: it starts once the runs before it have ended, and the runs after it wait
for it, so it is never starved. A run lives in memory
while the coordinator is up and in its run directory on disk (run.json,
events.jsonl) across restarts. A coordinator that starts reloads every run
with its events (sequence numbers continue); a run that was running resumes
from its last checkpoint by itself (`checkpointing.auto_resume`, unless the
cluster file sets the coordinator's `resume_on_restart: false`, in which
case it is marked FAILED with the command that resumes it).

A submitted run is QUEUED at once; its preflight (checks that need the model
or the data) runs beside the queue, and a run starts only after its
preflight passed. Run ids name folders in the runs directory, so a new id
and a resumed one are checked alike; a run that SUCCEEDED or was CANCELLED
is resumed only to extend it (a larger `grpo.max_num_steps`, or the max_num_steps of its algorithm's
section).

Every call acts for a principal (`rlserve.security.principal`): a run
belongs to its submitter, and a user sees and acts on their own runs only.
Another user's run answers exactly what a run that does not exist answers
(NOT_FOUND, the same message), a new run's id starts with its owner's name
(`alice.exp1`), so ALREADY_EXISTS only ever names the caller's own runs, and
a spec may name only the caller's own run folders. Admins see every run and
its owner. The tenancy policy (`rlserve.tenancy`, read live from the cluster
file) bounds the queue, the runs that train at once, and per user their
unfinished runs, their waiting runs, a run's size and its priority.

A run its user drives call by call (a Tinker model's, `open_run`: `rlserve.tinker`) is owned, queued,
counted against the quotas and cancelled like any run; it waits in the call that opens it while the
user's quota or the queue is full, its own body runs it, its calls record what it spends, and it is never
resumed (a coordinator that restarts ends it: its session is gone, its checkpoints stay).

States: QUEUED -> RUNNING -> SUCCEEDED | FAILED | PAUSED | CANCELLING -> CANCELLED (PAUSED: the
consistency guard stopped it after a checkpoint; `resume` continues it like a FAILED run).
A run that ends has a balanced ledger: what was in flight when it failed or
was cancelled is dropped with reason `failed` or `cancelled`. A cancelled
run is CANCELLED within `cancel_grace_s`: a task still winding down by then
(releasing a learner that does not answer) is left to finish by itself, and
the queue moves on.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from rlserve.catalog import ALGORITHMS
from rlserve.config import RunSpec, SpecError, spec_to_yaml
from rlserve.logs import event
from rlserve.rpc import RpcError, already_exists, clean, failed_precondition, invalid_argument, not_found
from rlserve.runs.feed import Arrivals
from rlserve.runs.record import LEGACY_OWNER, STATE_NAMES, TERMINAL, Run, RunPaused
from rlserve.runs.spec_reader import SpecReader
from rlserve.security.paths import RunAccess
from rlserve.security.principal import SYSTEM, Principal
from rlserve.tenancy.live import LiveTenancy
from rlserve.tenancy.policy import OverLimit, TenancyPolicy
from rlserve.v1 import coordinator_pb2 as pb

log = logging.getLogger("rlserve.coordinator")
# Finished runs whose events stay in memory (the newest ones; the others' are read back when asked).
EVENTS_KEPT = 16
# A run id is a folder name inside the runs directory: no separators, no '..', not hidden.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

RunBody = Callable[[Run], Awaitable[None]]
# A run its user drives (`open_run`) checks the quota, the queue and its turn this often while it waits.
OPEN_POLL_S = 0.5


class Admission:
    """What a run must pass before it is queued (`check`, on the request path, cheap; it returns the spec
    with its files as confined absolute paths) and before it starts (`preflight`, off the request path,
    bounded by the manager's time-out). `rlserve.loop.admission.RunAdmission` is the cluster's."""

    async def check(self, spec: RunSpec, run_access: RunAccess | None) -> RunSpec:
        """`run_access`: the run folders the caller may name (None: every one)."""
        return spec

    async def preflight(self, spec: RunSpec) -> None:
        return None


@dataclass
class _Slot:
    """The manager's own bookkeeping of one run (the record itself is the API's)."""

    run: Run
    task: asyncio.Task | None = None
    preflight: asyncio.Task | None = None
    preflight_passed: bool = False
    cancel_requested: bool = False
    # What runs the run (None: the manager's body, rlserve's loop; a run its user drives has its own).
    body: RunBody | None = None

    @property
    def active(self) -> bool:
        return self.task is not None and not self.task.done() and self.run.state not in TERMINAL


def check_run_id(run_id: str) -> None:
    if not _RUN_ID.fullmatch(run_id):
        shown = run_id if len(run_id) <= 80 else run_id[:80] + "..."
        raise invalid_argument("run_id", f"{shown!r}: 1-128 letters, digits, '-', '_' or '.', starting with a "
                                         f"letter or digit")


def scoped_run_id(caller: Principal, run_id: str) -> str:
    """A new run's id in its owner's namespace, `NAME.ID` (kept if it starts so already): one user's ids never
    collide with another's, so a taken id tells nothing about other users' runs. The cluster's own calls
    (and an endpoint without authentication) keep the id as given."""
    if caller.name == SYSTEM.name or run_id.startswith(caller.name + "."):
        return run_id
    scoped = f"{caller.name}.{run_id}"
    if not _RUN_ID.fullmatch(scoped):
        raise invalid_argument("run_id", f"{caller.name}.{run_id[:80]!r}: with your name in front, at most 128 "
                                         f"characters")
    return scoped


def _not_found(run_id: str) -> RpcError:
    """What a run the caller may not see answers: exactly what a run that does not exist answers."""
    return not_found(f"run {run_id!r}")


class RunManager:
    def __init__(self, runs_dir: Path, body: RunBody, admission: Admission, preflight_timeout_s: float,
                 resume_on_restart: bool = True, tenancy: LiveTenancy | None = None,
                 specs: SpecReader | None = None, cancel_grace_s: float = 60.0):
        self.runs_dir = runs_dir
        self.cancel_grace_s = cancel_grace_s
        self.body = body
        self.admission = admission
        self.preflight_timeout_s = preflight_timeout_s
        self.resume_on_restart = resume_on_restart
        # None: the default policy (the coordinator passes the cluster file's).
        self.tenancy = tenancy or LiveTenancy(TenancyPolicy())
        self._slots: dict[str, _Slot] = {}
        self.queue: list[str] = []
        self.closing = False
        self.specs = specs or SpecReader()
        # Runs taken in, for the gateway's run feed (`rlserve.runs.feed`), which sleeps while every run is finished.
        self.arrivals = Arrivals()
        runs_dir.mkdir(parents=True, exist_ok=True)
        self._load_earlier_runs()

    @property
    def runs(self) -> dict[str, Run]:
        return {run_id: slot.run for run_id, slot in self._slots.items()}

    def _load_earlier_runs(self) -> None:
        """Runs of earlier coordinators stay visible with their events; those it left active continue."""
        for path in sorted(self.runs_dir.glob("*/run.json")):
            try:
                run = Run.from_disk(path.parent)
                run.to_proto()  # a run whose record does not fit the API is skipped, not every ListRuns
            except (KeyError, TypeError, ValueError, SpecError, OSError) as err:
                log.warning("skipping run directory %s: %s", path.parent, err)
                continue
            self._slots[run.run_id] = _Slot(run)
        active = sorted((s.run for s in self._slots.values() if s.run.state not in TERMINAL),
                        key=lambda r: (r.state != pb.RUN_STATE_RUNNING, r.created))
        for run in active:
            was = STATE_NAMES[run.state]
            if run.kind != "loop":  # a run its user drove (a Tinker model): its session ended with the coordinator
                run.end(pb.RUN_STATE_CANCELLED, f"the coordinator restarted while the {run.kind} run was {was}; its "
                        f"session ended (its checkpoints stay)", reason="cancelled")
            elif run.state == pb.RUN_STATE_CANCELLING:
                run.end(pb.RUN_STATE_CANCELLED, "the coordinator restarted while the run was cancelling",
                        reason="cancelled")
            elif self.resume_on_restart and run.spec.checkpointing.auto_resume:
                run.resume(f"the coordinator restarted while the run was {was}")
                run.emit(pb.EVENT_KIND_INFO, f"{run.resume_reason}; it continues from its last checkpoint")
                self._slots[run.run_id].preflight_passed = True  # it passed when it was submitted
                self.queue.append(run.run_id)
            else:
                why = ("checkpointing.auto_resume is off" if self.resume_on_restart
                       else "the coordinator's resume_on_restart is off")
                run.end(pb.RUN_STATE_FAILED, f"the coordinator stopped while the run was {was} ({why}); resume "
                        f"with `rlserve submit --resume {run.run_id}`", reason="failed")
        self._forget_old_events()
        if self.queue:
            self._schedule()

    def _forget_old_events(self) -> None:
        finished = sorted((s.run for s in self._slots.values() if s.run.state in TERMINAL), key=lambda r: r.updated)
        for run in finished[:-EVENTS_KEPT]:
            run.forget_events()

    async def _load_spec(self, spec_yaml: str, caller: Principal) -> RunSpec:
        """Read in a process of its own, each caller's specs in turn with the others' (`spec_reader`), so one
        caller's specs never hold up the others' calls or the runs."""
        try:
            return await self.specs.read(spec_yaml, caller.name)
        except SpecError as err:
            raise invalid_argument(f"spec_yaml: {err.first_path}", "; ".join(err.problems)) from None

    def _visible(self, run_id: str, caller: Principal) -> _Slot | None:
        slot = self._slots.get(run_id)
        return slot if slot is not None and caller.may_access(slot.run.owner) else None

    def _run_access(self, caller: Principal) -> RunAccess | None:
        """The run folders a spec of `caller` may name: their own runs' (every one for an admin)."""
        if caller.is_admin:
            return None
        return lambda folder: self._visible(folder, caller) is not None

    async def _resumed_spec(self, run_id: str, spec_yaml: str, caller: Principal) -> RunSpec:
        """The stored spec; with `spec_yaml`, that spec, which may differ only in the max_num_steps of the
        run's algorithm (grpo.max_num_steps, sft.max_num_steps, dpo.max_num_steps).

        A run that SUCCEEDED or was CANCELLED is resumed only when the request asks to extend it: a spec
        whose max_num_steps is larger than the steps it did. A run folder without a record (its run.json
        unreadable) has no owner to check: only an admin resumes it.
        """
        run_dir = self.runs_dir / run_id
        slot = self._visible(run_id, caller)
        if not (run_dir / "spec.yaml").is_file() or (slot is None and not caller.is_admin):
            raise _not_found(run_id)
        if slot is not None and slot.run.kind != "loop":
            raise failed_precondition(f"run {run_id!r} is a {slot.run.kind} run, driven by its user's calls: it is "
                                      f"not resumed (start a new one from its checkpoints)")
        earlier = slot.run if slot else None
        if earlier is not None and earlier.state not in TERMINAL:
            raise failed_precondition(f"run {run_id!r} is {STATE_NAMES[earlier.state]}")
        access = self._run_access(caller)
        stored = await self.admission.check(await self._load_spec((run_dir / "spec.yaml").read_text(), caller),
                                            access)
        section = ALGORITHMS[stored.algorithm].section
        spec, key = stored, f"{section}.max_num_steps"
        if spec_yaml.strip():
            spec = await self.admission.check(await self._load_spec(spec_yaml, caller), access)
            mine, theirs = stored.model_dump(mode="json"), spec.model_dump(mode="json")
            for dump in (mine, theirs):  # a run the consistency guard paused may resume under another bound
                dump[section].pop("max_num_steps")
                dump["loss_fn"].pop("mismatch_guard")
            if mine != theirs:
                raise invalid_argument("spec_yaml", f"when resuming, only {key} and loss_fn.mismatch_guard may "
                                                    f"change")
        if earlier is not None and earlier.state in (pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_CANCELLED) and (
                not spec_yaml.strip() or spec.max_num_steps <= earlier.step):
            raise failed_precondition(
                f"run {run_id!r} {STATE_NAMES[earlier.state]} at step {earlier.step}; to continue it, resume "
                f"with a spec whose {key} is larger than {earlier.step}")
        return spec

    async def _new_spec(self, spec_yaml: str, run_id: str, caller: Principal) -> tuple[RunSpec, str]:
        """A new run's spec (its files confined) and its id in the caller's namespace."""
        spec = await self._load_spec(spec_yaml, caller)
        run_id = scoped_run_id(caller, run_id or f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-"
                                                 f"{secrets.token_hex(2)}")
        if run_id in self._slots or (self.runs_dir / run_id).exists():
            raise already_exists(f"run {run_id!r} exists")
        # Files confined to the cluster's directories (and the caller's own runs), plug-ins and reward
        # servers allow-listed.
        return await self.admission.check(spec, self._run_access(caller)), run_id

    def _counts(self, caller: Principal) -> tuple[int, int]:
        """`caller`'s runs that have not finished, and those of them that wait in the queue."""
        mine = [s.run for s in self._slots.values() if s.run.owner == caller.name]
        return (sum(r.state not in TERMINAL for r in mine),
                sum(self._slots[run_id].run.owner == caller.name for run_id in self.queue))

    async def submit(self, spec_yaml: str, run_id: str, resume: bool, caller: Principal) -> Run:
        if resume and not run_id:
            raise invalid_argument("run_id", "required with resume")
        self.tenancy.current().check_queue(len(self.queue))
        if run_id:
            check_run_id(run_id)
        if resume:
            spec = await self._resumed_spec(run_id, spec_yaml, caller)
        else:
            spec, run_id = await self._new_spec(spec_yaml, run_id, caller)
            if run_id in self._slots:  # taken by a call of the same caller while this one was checked
                raise already_exists(f"run {run_id!r} exists")
        # From here to the queue without an await: two calls at once cannot both take a user's last place.
        self.tenancy.current().check_submit(caller, spec, *self._counts(caller))
        run_dir = self.runs_dir / run_id
        earlier = self._slots.get(run_id) if resume else None
        if earlier is not None:
            run = earlier.run  # it keeps its history (events, ledger, step) and owner until its checkpoint is restored
        else:
            # A resumed folder without a record has no owner on record: like runs from before owners, `user`'s.
            run = Run(run_id, spec, run_dir, LEGACY_OWNER if resume else caller.name)
        slot = _Slot(run)
        if resume:
            run.resume("resumed by SubmitRun", spec)
        (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
        self._slots[run_id] = slot
        self.queue.append(run_id)
        run.set_state(pb.RUN_STATE_QUEUED)
        self.arrivals.note()
        run.emit(pb.EVENT_KIND_INFO, f"{'resumed' if resume else 'submitted'} by {caller.name}")
        event(log, "run.submitted", run=run_id, owner=run.owner, caller=caller.name, resume=resume)
        slot.preflight = asyncio.get_running_loop().create_task(self._preflight(slot))
        return run

    async def open_run(self, caller: Principal, spec: RunSpec, run_id: str, kind: str, body: RunBody,
                       waiting: Callable[[str, str], None]) -> Run:
        """A run its user drives call by call (`kind`: a Tinker model), which `body` runs once it starts. It waits
        while the user's quota or the queue is full (`waiting("quota" | "capacity", why)`), then queues like any
        run (its caller checked its spec: no preflight) and waits for its turn (`waiting("capacity", why)`);
        returns once it runs. Cancelling the call cancels the run."""
        check_run_id(run_id)
        if run_id in self._slots or (self.runs_dir / run_id).exists():
            raise already_exists(f"run {run_id!r} exists")
        while True:
            policy = self.tenancy.current()
            try:
                policy.check_queue(len(self.queue))
            except OverLimit as err:
                waiting("capacity", err.message)
                await asyncio.sleep(OPEN_POLL_S)
                continue
            try:
                policy.check_submit(caller, spec, *self._counts(caller))
            except OverLimit as err:
                waiting("quota", err.message)
                await asyncio.sleep(OPEN_POLL_S)
                continue
            break
        run = Run(run_id, spec, self.runs_dir / run_id, caller.name, kind)
        (run.run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
        self._slots[run_id] = _Slot(run, preflight_passed=True, body=body)
        self.queue.append(run_id)
        run.set_state(pb.RUN_STATE_QUEUED)
        run.emit(pb.EVENT_KIND_INFO, f"opened by {caller.name}")
        event(log, "run.opened", run=run_id, owner=run.owner, kind=kind)
        self._schedule()
        try:
            while run.state == pb.RUN_STATE_QUEUED:
                waiting("capacity", self._why_waiting(run_id))
                await asyncio.sleep(OPEN_POLL_S)
        except asyncio.CancelledError:
            self.cancel(run_id, caller)
            raise
        if run.state != pb.RUN_STATE_RUNNING:
            raise failed_precondition(f"run {run_id!r} is {STATE_NAMES[run.state]}: {run.error}")
        return run

    def _why_waiting(self, run_id: str) -> str:
        ahead = self.queue.index(run_id) if run_id in self.queue else 0
        active = [s.run for s in self._slots.values() if s.active]
        alone = [r.run_id for r in active if not r.spec.shares_deployed_base]
        if alone:
            return f"run {alone[0]!r} trains the whole policy and has the cluster alone until it ends"
        return (f"{len(active)} runs train (tenancy.cluster.max_training_runs: "
                f"{self.tenancy.current().cluster.max_training_runs}) and {ahead} wait before this one")

    async def _preflight(self, slot: _Slot) -> None:
        run = slot.run
        run.emit(pb.EVENT_KIND_INFO, "preflight: checking the model, the data and the reward functions")
        try:
            await asyncio.wait_for(self.admission.preflight(run.spec), self.preflight_timeout_s)
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
                slot.preflight_passed = True
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

    def list_protos(self, caller: Principal) -> list[pb.Run]:
        """The runs `caller` may see (an admin: every run, with its owner)."""
        protos = []
        for slot in self._slots.values():
            if not caller.may_access(slot.run.owner):
                continue
            try:
                protos.append(slot.run.to_proto())
            except (ValueError, TypeError) as err:  # one bad record must not hide the others
                log.warning("run %s cannot be listed: %s", slot.run.run_id, err)
        return protos

    def get(self, run_id: str, caller: Principal) -> Run:
        """The run, if `caller` may see it; another user's run is NOT_FOUND exactly like a missing one."""
        slot = self._visible(run_id, caller)
        if slot is None:
            raise _not_found(run_id)
        return slot.run

    def task(self, run_id: str) -> asyncio.Task | None:
        """The task running the run's body (None before it starts)."""
        return self._slots[run_id].task

    def cancel(self, run_id: str, caller: Principal) -> Run:
        """A queued run is cancelled at once; a running one becomes CANCELLING until its tasks stop."""
        run = self.get(run_id, caller)
        slot = self._slots[run_id]
        if run.state in TERMINAL or run.state == pb.RUN_STATE_CANCELLING:
            return run
        run.emit(pb.EVENT_KIND_INFO, f"CancelRun by {caller.name}")
        event(log, "run.cancel", run=run_id, owner=run.owner, caller=caller.name)
        if run_id in self.queue:
            self.queue.remove(run_id)
            if slot.preflight is not None:
                slot.preflight.cancel()
            run.end(pb.RUN_STATE_CANCELLED, "by CancelRun before it started", reason="cancelled")
        elif slot.task is not None:
            slot.cancel_requested = True
            run.set_state(pb.RUN_STATE_CANCELLING, f"by CancelRun at step {run.step}")
            slot.task.cancel()
            asyncio.get_running_loop().call_later(self.cancel_grace_s, self._cancel_overdue, slot, slot.task)
        return run

    def _cancel_overdue(self, slot: _Slot, task: asyncio.Task) -> None:
        """The cancelled task has not stopped within `cancel_grace_s`: the run ends CANCELLED now, and the
        task is left to finish by itself (what it still holds, it releases; a later run's Configure releases
        a learner session it left)."""
        if task.done() or slot.task is not task or slot.run.state != pb.RUN_STATE_CANCELLING:
            return
        event(log, "run.cancel_overdue", logging.WARNING, run=slot.run.run_id, step=slot.run.step,
              grace_s=self.cancel_grace_s)
        self._end(slot, pb.RUN_STATE_CANCELLED, f"by CancelRun at step {slot.run.step} (its task did not stop "
                                                f"within {self.cancel_grace_s:g}s and finishes by itself)",
                  "cancelled")

    async def shutdown(self) -> None:
        """The coordinator is going away: stop every run's task, leaving the runs as they are on disk."""
        self.closing = True
        tasks = [s.task for s in self._slots.values() if s.task is not None and not s.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.specs.close()

    def _may_start(self, head: _Slot) -> bool:
        """Whether the queue's head may start beside the runs that are active."""
        active = [s for s in self._slots.values() if s.active]
        if not active:
            return True
        shared = head.run.spec.shares_deployed_base and all(s.run.spec.shares_deployed_base for s in active)
        return shared and self.tenancy.current().may_train_beside(len(active))

    def _schedule(self) -> None:
        """Start queued runs in order while they may run beside the active ones; each waits until its
        preflight passed."""
        if self.queue:  # a run opened by its user (`open_run`) arrives here
            self.arrivals.note()
        while self.queue and not self.closing:
            head = self._slots[self.queue[0]]
            if not head.preflight_passed or not self._may_start(head):
                return  # a preflight or a run that ends calls _schedule again (a failed preflight unqueues)
            self.queue.pop(0)
            head.cancel_requested = False
            head.run.set_state(pb.RUN_STATE_RUNNING)
            head.task = asyncio.get_running_loop().create_task(self._execute(head))
            head.task.add_done_callback(lambda task, slot=head: self._cancelled_before_start(slot, task))

    def _cancelled_before_start(self, slot: _Slot, task: asyncio.Task) -> None:
        """A task cancelled before its first step never enters `_execute` (the cancellation is thrown
        into the coroutine before its `try`): end the run here, or it would stay CANCELLING for good."""
        if task.cancelled() and slot.cancel_requested:
            self._end(slot, pb.RUN_STATE_CANCELLED, f"by CancelRun at step {slot.run.step}", "cancelled")

    async def _execute(self, slot: _Slot) -> None:
        run = slot.run
        try:
            await (slot.body or self.body)(run)
        except asyncio.CancelledError:
            if not slot.cancel_requested:
                # The coordinator itself is going away: the run stays RUNNING on disk and the next
                # coordinator resumes it.
                raise
            self._end(slot, pb.RUN_STATE_CANCELLED, f"by CancelRun at step {run.step}", "cancelled")
        except RunPaused as err:
            self._end(slot, pb.RUN_STATE_PAUSED, str(err), "paused")
        except Exception as err:  # noqa: BLE001 - a run's failure is its state, never the coordinator's
            log.exception("run %s failed", run.run_id)
            self._end(slot, pb.RUN_STATE_FAILED, clean(str(err)) or type(err).__name__, "failed")  # no tracebacks
        else:
            self._end(slot, pb.RUN_STATE_SUCCEEDED)

    def _end(self, slot: _Slot, state: int, detail: str = "", reason: str = "") -> None:
        """The run's final state, then the queue moves on; nothing if it has ended already (a task that
        finished after `_cancel_overdue` ended its run)."""
        run = slot.run
        if run.state in TERMINAL:
            return
        if state == pb.RUN_STATE_FAILED:
            run.emit(pb.EVENT_KIND_ERROR, detail)
        run.end(state, detail, reason=reason)
        run.recorder.close()
        self._forget_old_events()
        self._schedule()
