"""The learner's training sessions, and what a worker's death does to them.

A session is one run's backend on the workers of a `WorkerGroup`
(`rlserve.learner.worker_group`). A full-parameter run has a group of its own,
and its Configure ends every other session (it trains alone); LoRA runs on the
deployed base (`shared_base`) of one worker layout share one group, whose
workers hold the frozen base once for all of them. A group's calls take turns:
each run gets its priority's share of the group's seconds
(`rlserve.tenancy.fair_share`), so a run with 10x longer sequences does not
take 10x the learner; every call goes to all ranks in one order, so the ranks'
collectives match.

A worker that dies in a run's own group takes its session (the run restores
its own checkpoint). A shared group heals instead: each run's trained state
(adapters, optimizer, random state: small) is snapshotted after every change,
into two folders in turn, so new workers are started, every run is configured
again and loaded from its last snapshot, and the call that met the death is
retried; the runs go on where they were. A run whose last snapshot failed
loses its session alone, and so does a run whose call kills the workers twice.

Errors are the service's statuses (`rlserve.rpc`): ABORTED when a session is
gone (the caller configures again and restores a checkpoint), INVALID_ARGUMENT
when a worker refuses the request's values, RESOURCE_EXHAUSTED when no workers
can be placed.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Concatenate

import grpc

from rlserve.config import RunSpec
from rlserve.learner.interfaces import BackendInfo, StepResult
from rlserve.learner.publishing import Published
from rlserve.learner.worker_group import NoRoom, P, StartGroup, T, WorkerDied, WorkerGroup, WorkerLayout
from rlserve.learner.worker_host import WorkerHost
from rlserve.logs import event
from rlserve.rpc import RpcError, aborted, failed_precondition, invalid_argument
from rlserve.tenancy.fair_share import FairShare
from rlserve.training.batch import TrainBatch
from rlserve.training.primitives import AdamStep, DatumBatch, PrimitiveResult

log = logging.getLogger("rlserve.learner")

# Worker calls after which a shared run's trained state is snapshotted (in the same turn).
_CHANGES_STATE = frozenset({WorkerHost.train_step, WorkerHost.load_checkpoint, WorkerHost.optim_step})


@dataclass
class SessionGroup:
    """A worker group and the runs training on it: one run's own, or (`shared`) the LoRA runs on the deployed
    base of its layout. Its runs' calls take turns (`turns`: one at a time, each run its priority's share of
    the seconds)."""

    workers: WorkerGroup
    shared: bool
    runs: set[str] = field(default_factory=set)
    turns: FairShare = field(default_factory=lambda: FairShare(1, exclusive=True))

    @asynccontextmanager
    async def turn(self, run_id: str, priority: float) -> AsyncIterator[None]:
        """The group to the run alone until the block ends, charged the seconds it took."""
        grant = await self.turns.acquire(run_id, priority)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.turns.release(grant, time.perf_counter() - t0)


@dataclass
class Snapshots:
    """A shared run's trained state, written after every change into two folders in turn: a death while
    writing one leaves the other whole."""

    folders: tuple[Path, Path]
    whole: Path | None = None  # the last whole snapshot; None: none yet
    failed: bool = False  # the last one failed: the run cannot be restored until one succeeds

    @classmethod
    def make(cls) -> Snapshots:
        folder = Path(tempfile.mkdtemp(prefix="rlserve-learner-snapshot-"))
        return cls((folder / "a", folder / "b"))

    def target(self) -> Path:
        """The folder for the next snapshot (not the last whole one's), emptied."""
        target = self.folders[1] if self.whole == self.folders[0] else self.folders[0]
        shutil.rmtree(target, ignore_errors=True)
        return target

    def drop(self) -> None:
        shutil.rmtree(self.folders[0].parent, ignore_errors=True)


@dataclass
class Session:
    run_id: str
    spec: RunSpec
    # What the run's workers are configured with (again after a heal), with the spec.
    model_path: Path
    init_adapter: Path | None
    shared_base: bool
    group: SessionGroup
    snapshots: Snapshots | None  # in a shared group only
    version: int = 0
    # (version before, result) of the last step, to answer a retried step without training twice.
    last_step: tuple[int, StepResult] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # the run's calls one at a time (a retry waits)

    @property
    def worker_setup(self) -> tuple[RunSpec, Path, Path | None, bool]:
        """`WorkerHost.configure`'s arguments after the run id."""
        return self.spec, self.model_path, self.init_adapter, self.shared_base


class SessionTable:
    """Every run's session, the worker groups they train on (started with `start_group`), and the heal
    policy. Sessions and groups come and go one at a time (`lock`)."""

    def __init__(self, start_group: StartGroup):
        self._start_group = start_group
        self.sessions: dict[str, Session] = {}
        self.groups: list[SessionGroup] = []
        self.lock = asyncio.Lock()

    def session(self, run_id: str) -> Session:
        session = self.sessions.get(run_id)
        if session is None:
            raise aborted(f"the learner holds no training session for run {run_id!r} (never configured, a "
                          f"worker died or the replica restarted); call Configure and restore a checkpoint")
        return session

    async def configure(self, run_id: str, spec: RunSpec, model_path: Path, init_adapter: Path | None,
                        shared_base: bool) -> BackendInfo:
        """A new session for the run (its old one, and sessions that cannot train beside it, end): in the
        shared group of its layout with `shared_base`, else in a group of its own."""
        if shared_base and not spec.policy.lora.enabled:
            raise invalid_argument("shared_base", "only a LoRA run shares the frozen base; this spec trains "
                                                  "every weight")
        layout = WorkerLayout.of(spec)
        async with self.lock:
            await self._release(run_id)
            await self._release_stale(shared_base, run_id)
            t0 = time.perf_counter()
            group = next((g for g in self.groups if shared_base and g.shared and g.workers.layout == layout), None)
            if group is None:
                group = await self._new_group(layout, shared_base)
            session = Session(run_id, spec, model_path, init_adapter, shared_base, group,
                              Snapshots.make() if shared_base else None)
            async with group.turn(run_id, spec.priority):
                info = await self._open(session)
        event(log, "learner.configured", run=run_id, backend=info.backend, layout=info.parallel_layout,
              params=info.num_parameters, device=info.device, shared_with=sorted(group.runs - {run_id}),
              seconds=time.perf_counter() - t0)
        return info

    async def train_step(self, run_id: str, batch: TrainBatch, loss_name: str, lr: float | None,
                         expected_version: int | None) -> StepResult:
        """One step of `loss_name` (`batch` may be a reference a WorkerGroup resolves on the workers: Ray's
        ObjectRef). A retried step (`expected_version` one behind) gets the answer it missed."""
        session = self.session(run_id)
        async with session.lock:
            if expected_version is not None and expected_version != session.version:
                if session.last_step is not None and session.last_step[0] == expected_version:
                    return session.last_step[1]
                raise aborted(f"step expects weight version {expected_version}, the learner is at {session.version}")
            result, *_ = await self._call(session, WorkerHost.train_step, batch, loss_name, lr)
            session.last_step, session.version = (session.version, result), result.version
            return result

    async def forward_primitive(self, run_id: str, batch: DatumBatch, backward: bool) -> PrimitiveResult:
        """`forward` (or with `backward` `forward_backward`: gradients kept until `optim_step`) of the run's
        datums; rank 0's answer."""
        session = self.session(run_id)
        async with session.lock:
            result, *_ = await self._call(session, WorkerHost.forward_primitive, batch, backward)
            return result

    async def optim_step(self, run_id: str, step: AdamStep) -> StepResult:
        """One optimizer update on the run's accumulated gradients. (A heal restores the last snapshot, taken
        after each update: gradients accumulated since are lost with the workers.)"""
        session = self.session(run_id)
        async with session.lock:
            result, *_ = await self._call(session, WorkerHost.optim_step, step)
            session.version, session.last_step = result.version, None
            return result

    async def export(self, run_id: str, store_name: str, direct: bool, in_flight: bool, timeout_s: float,
                     shared_base: bool) -> Published:
        """Publish the run's current weights (rank 0 says what it did)."""
        session = self.session(run_id)
        if shared_base and not session.spec.policy.lora.enabled:
            raise invalid_argument("shared_base", "only a LoRA run's adapter is served beside other runs'")
        async with session.lock:
            out, *_ = await self._call(session, WorkerHost.export, store_name, direct, in_flight, timeout_s,
                                       shared_base)
        event(log, "learner.weights_published", run=run_id, version=out.version, buckets=out.num_buckets,
              tensors=out.num_tensors, mb=out.num_bytes / 2**20, seconds=out.seconds,
              direct_mb=out.direct_bytes / 2**20, receivers=out.receivers, failed=out.failures or None)
        return out

    async def save_checkpoint(self, run_id: str, path: Path, hf_path: Path | None) -> int:
        """A checkpoint into `path` (and with `hf_path` the policy as an HF or PEFT folder); the version saved."""
        session = self.session(run_id)
        async with session.lock:
            await self._call(session, WorkerHost.save_checkpoint, path)
            if hf_path is not None:
                await self._call(session, WorkerHost.save_hf, hf_path)
            return session.version

    async def load_checkpoint(self, run_id: str, path: Path) -> int:
        """The run's state from checkpoint `path`; its version."""
        session = self.session(run_id)
        async with session.lock:
            version, *_ = await self._call(session, WorkerHost.load_checkpoint, path)
            session.version, session.last_step = version, None
            return version

    async def release(self, run_id: str) -> bool:
        """End the run's session; False when it had none."""
        async with self.lock:
            released = await self._release(run_id)
        if released:
            event(log, "learner.released", run=run_id)
        return released

    async def _new_group(self, layout: WorkerLayout, shared: bool) -> SessionGroup:
        try:
            workers = await self._start_group(layout)
        except NoRoom as err:
            busy = f"; {len(self.sessions)} other runs' sessions hold theirs" if self.sessions else ""
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err}{busy}") from None
        group = SessionGroup(workers, shared)
        self.groups.append(group)
        return group

    async def _open(self, session: Session) -> BackendInfo:
        """The session into the table and its backend onto its group's workers (in the run's turn); if that
        fails, neither stays, nor a group left without runs."""
        run_id, group = session.run_id, session.group
        group.runs.add(run_id)
        self.sessions[run_id] = session
        try:
            info, *_ = await self._all(group, WorkerHost.configure, run_id, *session.worker_setup)
            return info
        except BaseException:
            if run_id in group.runs:  # else its group is gone, and the session with it
                self._forget(session)
                if not group.runs:
                    self._teardown(group)
            raise

    async def _call(self, session: Session, method: Callable[Concatenate[WorkerHost, str, P], T],
                    *args: P.args, **kwargs: P.kwargs) -> list[T]:
        """`method` of the run on every rank of its group, in its turn. In a shared group a worker's death
        heals the group and the call is retried once; a second death in the same call ends this run's
        session alone."""
        group = session.group
        async with group.turn(session.run_id, session.spec.priority):
            try:
                return await self._attempt(session, method, *args, **kwargs)
            except WorkerDied as err:
                if not group.shared:
                    raise self._lost(group, err) from None
                await self._heal(group, err)
            try:
                return await self._attempt(session, method, *args, **kwargs)
            except WorkerDied as err:
                self._forget(session)
                await self._heal(group, err)
                raise aborted(f"a learner worker died twice running {method.__name__} of run {session.run_id!r}; "
                              f"its training session is gone (the other runs of its group go on): call Configure "
                              f"and restore a checkpoint") from None

    async def _attempt(self, session: Session, method: Callable[Concatenate[WorkerHost, str, P], T],
                       *args: P.args, **kwargs: P.kwargs) -> list[T]:
        """`method` once, then the snapshot of the run's trained state if the call changed it."""
        if session.run_id not in session.group.runs:
            raise aborted(f"the training session of run {session.run_id!r} is gone (its group's worker died)")
        results = await self._ranks(session.group, method, session.run_id, *args, **kwargs)
        if method in _CHANGES_STATE:
            await self._snapshot(session)
        return results

    async def _ranks(self, group: SessionGroup, method: Callable[Concatenate[WorkerHost, P], T],
                     *args: P.args, **kwargs: P.kwargs) -> list[T]:
        """`method` on every rank; a worker's death comes out as WorkerDied, a rank refusing the request's
        values as INVALID_ARGUMENT."""
        try:
            return await group.workers.call_all(method, *args, **kwargs)
        except ValueError as err:  # SpecError and UnsupportedModel too
            raise invalid_argument("request", str(err).splitlines()[0]) from None
        except NotImplementedError as err:  # a backend without the primitives
            raise failed_precondition(str(err).splitlines()[0]) from None

    async def _all(self, group: SessionGroup, method: Callable[Concatenate[WorkerHost, P], T],
                   *args: P.args, **kwargs: P.kwargs) -> list[T]:
        """`method` on every rank; a worker's death ends the group and its sessions."""
        try:
            return await self._ranks(group, method, *args, **kwargs)
        except WorkerDied as err:
            raise self._lost(group, err) from None

    async def _snapshot(self, session: Session) -> None:
        """A shared run's trained state, into the snapshot folder not holding the last whole one."""
        snapshots = session.snapshots
        if snapshots is None:
            return
        target = snapshots.target()
        try:
            await self._ranks(session.group, WorkerHost.save_snapshot, session.run_id, target)
        except WorkerDied:
            raise
        except Exception as err:  # noqa: BLE001 - whatever a rank raised
            # The step stands; only healing is lost for this run (a heal drops its session: it restores its
            # own checkpoint), until a later snapshot succeeds.
            snapshots.failed = True
            event(log, "learner.snapshot_failed", logging.WARNING, run=session.run_id, error=str(err)[:300])
            return
        snapshots.whole, snapshots.failed = target, False

    async def _heal(self, group: SessionGroup, err: WorkerDied) -> None:
        """New workers for a shared group whose worker died, each run configured again and restored from its
        last snapshot, where it was. A run that cannot be restored loses its session alone; if the new
        workers fail too, the group and its sessions go."""
        runs = sorted(group.runs)
        if not runs:
            self._teardown(group)
            return
        t0 = time.perf_counter()
        try:
            await group.workers.restart()
            lost = [run_id for run_id in runs if not await self._restore(self.sessions[run_id])]
        except Exception as heal_err:  # noqa: BLE001 - whatever stopped the new workers
            event(log, "learner.heal_failed", logging.WARNING, runs=runs, error=str(heal_err)[:300])
            raise self._lost(group, err) from None
        event(log, "learner.healed", logging.WARNING, runs=sorted(group.runs), lost=lost or None,
              error=err.reason, seconds=time.perf_counter() - t0)

    async def _restore(self, session: Session) -> bool:
        """Configure the run on the group's new workers and load its last snapshot; False (its session gone)
        when it has no whole snapshot of its current version."""
        run_id, group, snapshots = session.run_id, session.group, session.snapshots
        await self._ranks(group, WorkerHost.configure, run_id, *session.worker_setup)
        if snapshots.whole is None and not snapshots.failed and session.version == 0:
            return True  # as configured
        try:
            if snapshots.failed or snapshots.whole is None:
                raise RuntimeError("its last snapshot failed" if snapshots.failed else "it has no snapshot")
            version, *_ = await self._ranks(group, WorkerHost.load_snapshot, run_id, snapshots.whole)
            if version != session.version:
                raise RuntimeError(f"its snapshot is at version {version}, its session at {session.version}")
            return True
        except WorkerDied:
            raise
        except Exception as why:  # noqa: BLE001 - whatever a rank raised
            await self._ranks(group, WorkerHost.release, run_id)
            self._forget(session)
            event(log, "learner.run_not_restored", logging.WARNING, run=run_id, error=str(why)[:300])
            return False

    def _lost(self, group: SessionGroup, err: WorkerDied) -> RpcError:
        """The group and its sessions are gone: the error to answer with."""
        lost = sorted(group.runs)
        self._teardown(group)
        event(log, "learner.worker_died", logging.WARNING, runs=lost, error=err.reason)
        return aborted(f"a learner worker died ({err.reason}); the training sessions of its group "
                       f"({', '.join(lost)}) are gone: call Configure and restore a checkpoint")

    def _forget(self, session: Session) -> None:
        """The session leaves the table and its group (its backend, if any, stays on the workers)."""
        session.group.runs.discard(session.run_id)
        if self.sessions.get(session.run_id) is session:
            del self.sessions[session.run_id]
        if session.snapshots is not None:
            session.snapshots.drop()

    def _teardown(self, group: SessionGroup) -> None:
        """The group's workers and resources go, and with them every session in it."""
        group.workers.close()
        if group in self.groups:
            self.groups.remove(group)
        for session in [s for s in self.sessions.values() if s.group is group]:
            self._forget(session)
        group.runs.clear()

    async def _release(self, run_id: str) -> bool:
        """End the run's session: its own group goes; in a shared group, only its backend (the caller holds
        `self.lock`)."""
        session = self.sessions.get(run_id)
        if session is None:
            return False
        group = session.group
        if group.runs == {run_id}:
            self._teardown(group)
            return True
        self._forget(session)
        async with group.turn(run_id, session.spec.priority):
            await self._all(group, WorkerHost.release, run_id)
        return True

    async def _release_stale(self, shared: bool, for_run: str) -> None:
        """A run that needs the policy alone comes only when no other trains (the coordinator sees to it), and
        shared runs never beside one: sessions held against that are stale (a caller that never released them)
        and would hold their workers' CPUs and GPUs for good (the caller holds `self.lock`)."""
        stale = [r for r, s in self.sessions.items() if not shared or not s.group.shared]
        for run_id in stale:
            await self._release(run_id)
            event(log, "learner.stale_session_released", logging.WARNING, run=run_id, for_run=for_run)
