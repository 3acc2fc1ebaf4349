"""The learner Serve application: `rlserve.v1.Learner` over a group of worker actors.

The replica holds the runs' training sessions. A session lives in a worker
group: a placement group of `cluster.num_workers` bundles and one LearnerWorker
per bundle, forming a torch.distributed group (gloo on CPU, NCCL on GPU). A
full-parameter run has a group of its own, and its Configure ends every other
session (it trains alone); LoRA runs on the deployed base (`shared_base`) of
one worker layout share one group, whose workers hold the
frozen base once for all of them. A group's calls take turns: each run gets its
priority's share of the group's seconds (`rlserve.tenancy.fair_share`), so a run
with 10x longer sequences does not take 10x the learner.

A worker that dies in a run's own group takes its session (the run restores
its own checkpoint). A shared group heals instead: each run's trained state
(adapters, optimizer, random state: small) is snapshotted after every change,
so new workers are started, every run is configured again and restored, and
the call that met the death is retried; the runs go on where they were. A call
that kills the workers twice loses its run's session alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import ray
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlserve import cpu_affinity
from rlserve.algorithms.registry import LOSSES, make_loss
from rlserve.cluster.deployment import build_app
from rlserve.config import RunSpec, SpecError, load_spec
from rlserve.learner.checkpoint import is_checkpoint
from rlserve.learner.publisher import Published
from rlserve.logs import event, setup_logging
from rlserve.models import resolve_model
from rlserve.rpc import RpcError, aborted, grpc_method, invalid_argument
from rlserve.tenancy.fair_share import FairShare
from rlserve.security.paths import PathsArgs
from rlserve.training.batch import TrainBatch
from rlserve.v1 import learner_pb2
from rlserve.weights import adapter
from rlserve.weights.store import DEFAULT_STORE_NAME
from services.learner.worker import LearnerWorker

log = logging.getLogger("rlserve.learner")


class LearnerArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_store: str = DEFAULT_STORE_NAME
    # Seconds to wait for the workers' resources before Configure fails.
    placement_timeout_s: float = 120.0
    # A rollout replica that does not answer a step of a direct weight transfer within this is
    # dropped from it (it catches up from the store copy).
    weight_transfer_timeout_s: float = 120.0
    # Models are read from the model directories; checkpoints and exports go to the runs directory only.
    paths: PathsArgs = PathsArgs()


@dataclass
class WorkerGroup:
    """One worker per rank in a placement group, forming one torch.distributed group. A full-parameter run
    (or a LoRA run on its own base) has its own; LoRA runs on the deployed base of one layout share one.
    Its runs' calls take turns (`turns`: one at a time, each run its priority's share of the seconds),
    each issued to every rank in one order, so the ranks' collectives match."""

    layout: tuple | None  # the shared group's worker layout; None: one run's own group
    pg: object
    workers: list
    rendezvous: Path
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
class Session:
    run_id: str
    spec: RunSpec
    group: WorkerGroup
    version: int = 0
    # (version before, response) of the last step, to answer a retried step without training twice.
    last_step: tuple[int, learner_pb2.TrainStepResponse] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # the run's calls one at a time (a retry waits)
    # In a shared group: the workers' configure arguments after the run id, and two snapshot folders
    # written in turn (a death while writing one leaves the other whole); `snapshot` is the last whole
    # (-1: none yet, the run is as configured; -2: the last one failed, the run cannot be restored).
    configure_args: tuple = ()
    snapshots: tuple[Path, Path] | None = None
    snapshot: int = -1

    def drop_snapshots(self) -> None:
        if self.snapshots:
            shutil.rmtree(self.snapshots[0].parent, ignore_errors=True)


# Calls after which a shared run's trained state is snapshotted (in the same turn).
_CHANGES_STATE = frozenset({"train_step", "load_checkpoint"})


def _layout(spec: RunSpec) -> tuple:
    cl = spec.cluster
    return cl.num_workers, cl.cpus_per_worker, cl.gpus_per_worker, cl.device, cl.torch_threads


def batch_from_proto(request: learner_pb2.TrainStepRequest, generator_logprobs: bool) -> TrainBatch:
    """The inline batch; `generator_logprobs`: the loss uses them (one per completion token)."""
    seqs = request.sequences
    if not seqs:
        raise invalid_argument("sequences", "empty batch")
    try:
        return TrainBatch.from_sequences(
            [list(s.token_ids) for s in seqs], [s.prompt_length for s in seqs], [s.advantage for s in seqs],
            [list(s.generator_logprobs) for s in seqs] if generator_logprobs else None,
            [list(s.reference_logprobs) for s in seqs] if any(s.reference_logprobs for s in seqs) else None,
            [list(s.token_advantages) for s in seqs] if any(s.token_advantages for s in seqs) else None,
            [list(s.loss_mask) or [True] * (len(s.token_ids) - s.prompt_length) for s in seqs]
            if any(s.loss_mask for s in seqs) else None)
    except ValueError as err:
        raise invalid_argument("sequences", str(err)) from None


@serve.deployment(max_ongoing_requests=64)
class Learner:
    def __init__(self, args: dict | None = None):
        setup_logging()
        cpu_affinity.place_from_env()
        self.args = LearnerArgs.model_validate(args or {})
        self.paths = self.args.paths.policy()
        self.sessions: dict[str, Session] = {}
        self.groups: list[WorkerGroup] = []
        self.lock = asyncio.Lock()  # sessions and groups come and go one at a time

    def _teardown(self, group: WorkerGroup) -> None:
        """The group's workers and resources go, and with them every session in it."""
        for w in group.workers:
            ray.kill(w)
        if group.pg is not None:
            remove_placement_group(group.pg)
        group.rendezvous.unlink(missing_ok=True)
        if group in self.groups:
            self.groups.remove(group)
        for run_id in group.runs:
            session = self.sessions.pop(run_id, None)
            if session is not None:
                session.drop_snapshots()
        group.runs.clear()

    def _require(self, run_id: str) -> Session:
        session = self.sessions.get(run_id)
        if session is None:
            raise aborted(f"the learner holds no training session for run {run_id!r} (never configured, a "
                          f"worker died or the replica restarted); call Configure and restore a checkpoint")
        return session

    @staticmethod
    async def _ranks(group: WorkerGroup, run_id: str, method: str, *args) -> list:
        """`method` on every rank; a worker's death comes out as RayActorError."""
        try:
            return await asyncio.gather(*[getattr(w, method).remote(run_id, *args) for w in group.workers])
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if isinstance(err.cause, Exception) else err
            if isinstance(cause, (ValueError, SpecError)):
                raise invalid_argument("request", str(cause).splitlines()[0]) from None
            raise

    def _lost(self, group: WorkerGroup, err: Exception) -> RpcError:
        """The group and its sessions are gone: the error to answer with."""
        lost = sorted(group.runs)
        self._teardown(group)
        event(log, "learner.worker_died", logging.WARNING, runs=lost, error=err.__class__.__name__)
        return aborted(f"a learner worker died ({err.__class__.__name__}); the training sessions of its group "
                       f"({', '.join(lost)}) are gone: call Configure and restore a checkpoint")

    async def _all(self, group: WorkerGroup, run_id: str, method: str, *args) -> list:
        """`method` on every rank; a worker's death ends the group and its sessions."""
        try:
            return await self._ranks(group, run_id, method, *args)
        except ray.exceptions.RayActorError as err:
            raise self._lost(group, err) from None

    async def _call(self, session: Session, method: str, *args) -> list:
        """`method` on every rank of the session's group, in the run's turn (in a shared group, healed and
        retried once if a worker dies, then the run's trained state snapshotted if it changed)."""
        group = session.group
        async with group.turn(session.run_id, session.spec.priority):
            for attempt in (1, 2):
                if session.run_id not in group.runs:
                    raise aborted(f"the training session of run {session.run_id!r} is gone (its group's worker "
                                  f"died)")
                try:
                    results = await self._ranks(group, session.run_id, method, *args)
                    if method in _CHANGES_STATE:
                        await self._snapshot(session)
                    return results
                except ray.exceptions.RayActorError as err:
                    if group.layout is None:
                        raise self._lost(group, err) from None
                    if attempt == 2:  # the call itself kills the workers: its run goes, the others go on
                        self._drop_session(session)
                        await self._heal(group, err)
                        raise aborted(f"a learner worker died twice running {method} of run {session.run_id!r}; "
                                      f"its training session is gone (the other runs of its group go on): call "
                                      f"Configure and restore a checkpoint") from None
                    await self._heal(group, err)
        raise AssertionError("unreachable")

    async def _snapshot(self, session: Session) -> None:
        """A shared run's trained state, into the snapshot folder not holding the last whole one."""
        if session.snapshots is None:
            return
        target = 1 - session.snapshot if session.snapshot >= 0 else 0
        shutil.rmtree(session.snapshots[target], ignore_errors=True)
        try:
            await self._ranks(session.group, session.run_id, "save_snapshot", str(session.snapshots[target]))
        except (ray.exceptions.RayTaskError, RpcError) as err:
            # The step stands; only healing is lost for this run (a heal drops its session: it restores its
            # own checkpoint), until a later snapshot succeeds.
            session.snapshot = -2
            event(log, "learner.snapshot_failed", logging.WARNING, run=session.run_id, error=str(err)[:300])
            return
        session.snapshot = target

    def _drop_session(self, session: Session) -> None:
        session.group.runs.discard(session.run_id)
        self.sessions.pop(session.run_id, None)
        session.drop_snapshots()

    async def _heal(self, group: WorkerGroup, err: Exception) -> None:
        """New workers for a shared group whose worker died, each run configured again and restored from its
        last snapshot, where it was. A run that cannot be restored (its last snapshot failed) loses its
        session alone; if the new workers fail too, the group and its sessions go."""
        for w in group.workers:
            ray.kill(w)
        remove_placement_group(group.pg)
        group.rendezvous.unlink(missing_ok=True)
        group.pg, group.workers = None, []
        runs = sorted(group.runs)
        if not runs:
            self.groups.remove(group)
            return
        t0 = time.perf_counter()
        try:
            group.pg, group.workers, group.rendezvous = await self._start_workers(self.sessions[runs[0]].spec)
            lost = [run_id for run_id in runs if not await self._restore(self.sessions[run_id])]
        except (ray.exceptions.RayError, RpcError) as heal_err:
            event(log, "learner.heal_failed", logging.WARNING, runs=runs, error=str(heal_err)[:300])
            raise self._lost(group, err) from None
        event(log, "learner.healed", logging.WARNING, runs=sorted(group.runs), lost=lost or None,
              error=err.__class__.__name__, seconds=time.perf_counter() - t0)

    async def _restore(self, session: Session) -> bool:
        """Configure the run on the group's new workers and load its last snapshot; False (its session gone)
        when it has no whole snapshot of its current version."""
        run_id, group = session.run_id, session.group
        await self._ranks(group, run_id, "configure", *session.configure_args)
        if session.snapshot == -1 and session.version == 0:
            return True
        try:
            if session.snapshot < 0:
                raise RuntimeError("its last snapshot failed")
            versions = await self._ranks(group, run_id, "load_snapshot", str(session.snapshots[session.snapshot]))
            if versions[0] != session.version:
                raise RuntimeError(f"its snapshot is at version {versions[0]}, its session at {session.version}")
            return True
        except (ray.exceptions.RayTaskError, RuntimeError) as why:
            await self._ranks(group, run_id, "release")
            self._drop_session(session)
            event(log, "learner.run_not_restored", logging.WARNING, run=run_id, error=str(why)[:300])
            return False

    def _initial_policy(self, init_model_path: str, spec: RunSpec) -> tuple[Path, str | None]:
        """(the model folder, the PEFT adapter folder to start LoRA adapters from or None). `init_model_path`
        names an HF folder, or with LoRA an adapter folder (the run's SFT warm start) for the spec's base."""
        field = "init_model_path" if init_model_path else "spec_yaml: policy.model_name"
        name = self.paths.model_name(field, init_model_path or spec.policy.model_name)
        init_adapter = None
        if init_model_path and adapter.is_adapter_folder(Path(name)):
            if not spec.policy.lora.enabled:
                raise invalid_argument(field, f"{init_model_path[:200]} is a LoRA adapter; the run trains without LoRA")
            init_adapter, field = name, "spec_yaml: policy.model_name"
            name = self.paths.model_name(field, spec.policy.model_name)
        try:
            return resolve_model(name, spec.policy.model_seed), init_adapter
        except ValueError as err:
            raise invalid_argument(field, str(err)) from None

    async def _new_group(self, spec: RunSpec, layout: tuple | None) -> WorkerGroup:
        group = WorkerGroup(layout, *await self._start_workers(spec))
        self.groups.append(group)
        return group

    async def _start_workers(self, spec: RunSpec) -> tuple[object, list, Path]:
        """(placement group, one worker per rank, rendezvous file) for the spec's worker layout."""
        cl = spec.cluster
        pg = placement_group([{"CPU": cl.cpus_per_worker, "GPU": cl.gpus_per_worker}] * cl.num_workers,
                             strategy="PACK")
        try:
            await asyncio.wait_for(pg.ready(), self.args.placement_timeout_s)
        except asyncio.TimeoutError:
            remove_placement_group(pg)
            busy = f"; {len(self.sessions)} other runs' sessions hold theirs" if self.sessions else ""
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"no room for {cl.num_workers} learner workers of {cl.cpus_per_worker} CPU / "
                           f"{cl.gpus_per_worker} GPU within {self.args.placement_timeout_s:.0f}s{busy}") from None
        rendezvous = Path(tempfile.mkdtemp(prefix="rlserve-learner-")) / "rendezvous"
        workers = [LearnerWorker.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            num_cpus=cl.cpus_per_worker, num_gpus=cl.gpus_per_worker,
            # The service's cpu_cores (if any) and nice carry on to its workers.
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(min(cl.torch_threads, os.cpu_count() or 1)),
                                      cpu_affinity.ENV: os.environ.get(cpu_affinity.ENV, ""),
                                      cpu_affinity.NICE_ENV: os.environ.get(cpu_affinity.NICE_ENV, "")}},
        ).remote(i, cl.num_workers, f"file://{rendezvous}", cl.device, cl.torch_threads)
            for i in range(cl.num_workers)]
        return pg, workers, rendezvous

    async def _release(self, run_id: str) -> bool:
        """End the run's session: its own group goes; in a shared group, only its backend (the caller holds
        `self.lock`)."""
        session = self.sessions.pop(run_id, None)
        if session is None:
            return False
        session.drop_snapshots()
        group = session.group
        if group.runs == {run_id}:
            self._teardown(group)
        else:
            async with group.turn(run_id, session.spec.priority):
                await self._all(group, run_id, "release")
            group.runs.discard(run_id)
        return True

    async def _release_stale(self, layout: tuple | None, for_run: str) -> None:
        """A run that needs the policy alone comes only when no other trains (the coordinator sees to it), and
        shared runs never beside one: sessions held against that are stale (a caller that never released them)
        and would hold their workers' CPUs and GPUs for good (the caller holds `self.lock`)."""
        stale = [r for r, s in self.sessions.items() if layout is None or s.group.layout is None]
        for run_id in stale:
            await self._release(run_id)
            event(log, "learner.stale_session_released", logging.WARNING, run=run_id, for_run=for_run)

    @grpc_method
    async def Configure(self, request: learner_pb2.ConfigureRequest) -> learner_pb2.ConfigureResponse:
        if not request.run_id:
            raise invalid_argument("run_id", "required")
        try:
            spec = load_spec(request.spec_yaml)
        except SpecError as err:
            raise invalid_argument(f"spec_yaml: {err.first_path}", "; ".join(err.problems)) from None
        if request.shared_base and not spec.policy.lora.enabled:
            raise invalid_argument("shared_base", "only a LoRA run shares the frozen base; this spec trains "
                                                  "every weight")
        model_path, init_adapter = self._initial_policy(request.init_model_path, spec)
        layout = _layout(spec) if request.shared_base else None
        async with self.lock:
            await self._release(request.run_id)
            await self._release_stale(layout, request.run_id)
            t0 = time.perf_counter()
            group = next((g for g in self.groups if layout is not None and g.layout == layout), None)
            if group is None:
                group = await self._new_group(spec, layout)
            session = Session(request.run_id, spec, group,
                              configure_args=(request.spec_yaml, str(model_path), init_adapter, request.shared_base))
            if layout is not None:
                folder = Path(tempfile.mkdtemp(prefix="rlserve-learner-snapshot-"))
                session.snapshots = (folder / "a", folder / "b")
            async with group.turn(request.run_id, spec.priority):
                group.runs.add(request.run_id)
                self.sessions[request.run_id] = session
                try:
                    infos = await self._all(group, request.run_id, "configure", *session.configure_args)
                except BaseException:
                    session.drop_snapshots()
                    if request.run_id in group.runs:
                        group.runs.discard(request.run_id)
                        self.sessions.pop(request.run_id, None)
                        if not group.runs:
                            self._teardown(group)
                    raise
            info = infos[0]
            event(log, "learner.configured", run=request.run_id, backend=info.backend, layout=info.parallel_layout,
                  params=info.num_parameters, device=info.device, shared_with=sorted(group.runs - {request.run_id}),
                  seconds=time.perf_counter() - t0)
            return learner_pb2.ConfigureResponse(backend=info.backend, world_size=info.world_size,
                                                 parallel_layout=info.parallel_layout,
                                                 num_parameters=info.num_parameters, weight_version=0,
                                                 device=info.device)

    @grpc_method
    async def TrainStep(self, request: learner_pb2.TrainStepRequest,
                        batch_refs: list | None = None) -> learner_pb2.TrainStepResponse:
        """Inside the cluster, `batch_refs` holds one ObjectRef of a TrainBatch; gRPC callers send it inline."""
        if request.loss_name and request.loss_name not in LOSSES.names:
            raise invalid_argument("loss_name", f"unknown loss {request.loss_name[:64]!r}; valid: "
                                                f"{', '.join(LOSSES.names)} (empty: the run spec's loss_fn.name)")
        lr = request.learning_rate if request.HasField("learning_rate") else None
        if lr is not None and not lr > 0:
            raise invalid_argument("learning_rate", f"must be > 0, got {lr}")
        session = self._require(request.run_id)
        async with session.lock:
            if request.HasField("expected_weight_version") and request.expected_weight_version != session.version:
                last = session.last_step
                if last is not None and last[0] == request.expected_weight_version:
                    return last[1]
                raise aborted(f"step expects weight version {request.expected_weight_version}, "
                              f"the learner is at {session.version}")
            loss_name = request.loss_name or session.spec.loss_fn.name
            if batch_refs:
                ref = batch_refs[0]
            else:
                loss = make_loss(loss_name, session.spec.loss_fn)
                ref = ray.put(batch_from_proto(request, loss.needs_generator_logprobs))
            results = await self._call(session, "train_step", ref, loss_name, lr)
            response = learner_pb2.TrainStepResponse(weight_version=results[0].version, metrics=results[0].metrics)
            session.last_step = (session.version, response)
            session.version = results[0].version
            return response

    @grpc_method
    async def ExportWeights(self, request: learner_pb2.ExportWeightsRequest) -> learner_pb2.ExportWeightsResponse:
        store = request.store_name or self.args.weight_store
        session = self._require(request.run_id)
        if request.shared_base and not session.spec.policy.lora.enabled:
            raise invalid_argument("shared_base", "only a LoRA run's adapter is served beside other runs'")
        async with session.lock:
            results = await self._call(session, "export", store, request.direct, request.in_flight,
                                       self.args.weight_transfer_timeout_s, request.shared_base)
        out: Published = results[0]  # rank 0 publishes and says what it did; the other ranks answer None
        failed = [f"{who}: {why}" for who, why in out.failed.items()]
        event(log, "learner.weights_published", run=request.run_id, version=out.version,
              buckets=out.num_buckets, tensors=out.num_tensors, mb=out.num_bytes / 2**20, seconds=out.seconds,
              direct_mb=out.direct_bytes / 2**20, receivers=out.receivers, failed=failed or None)
        return learner_pb2.ExportWeightsResponse(
            weight_version=out.version, num_buckets=out.num_buckets, num_tensors=out.num_tensors,
            num_bytes=out.num_bytes, seconds=out.seconds, direct_bytes=out.direct_bytes,
            receivers=out.receivers, failed=failed, model_bytes=out.model_bytes,
            direct_seconds=out.direct_seconds, store_seconds=out.store_seconds)

    @grpc_method
    async def SaveCheckpoint(self, request: learner_pb2.SaveCheckpointRequest
                             ) -> learner_pb2.SaveCheckpointResponse:
        if not request.path:
            raise invalid_argument("path", "required")
        path = self.paths.run_path("path", request.path)
        hf_path = self.paths.run_path("hf_path", request.hf_path) if request.hf_path else None
        session = self._require(request.run_id)
        async with session.lock:
            await self._call(session, "save_checkpoint", str(path))
            if hf_path is not None:
                await self._call(session, "save_hf", str(hf_path))
        return learner_pb2.SaveCheckpointResponse(path=str(path), weight_version=session.version)

    @grpc_method
    async def LoadCheckpoint(self, request: learner_pb2.LoadCheckpointRequest
                             ) -> learner_pb2.LoadCheckpointResponse:
        path = self.paths.run_path("path", request.path)
        if not is_checkpoint(path):
            raise invalid_argument("path", f"{request.path[:200]} is not a learner checkpoint")
        session = self._require(request.run_id)
        async with session.lock:
            versions = await self._call(session, "load_checkpoint", str(path))
            session.version, session.last_step = versions[0], None
        return learner_pb2.LoadCheckpointResponse(weight_version=versions[0])

    @grpc_method
    async def ReleaseSession(self, request: learner_pb2.ReleaseSessionRequest) -> learner_pb2.ReleaseSessionResponse:
        async with self.lock:
            released = await self._release(request.run_id)
        if released:
            event(log, "learner.released", run=request.run_id)
        return learner_pb2.ReleaseSessionResponse(released=released)


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.learner.app:build`)."""
    return build_app(Learner, LearnerArgs, args)

