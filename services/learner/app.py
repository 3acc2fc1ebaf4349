"""The learner Serve application: `rlserve.v1.Learner` over a group of worker actors.

The replica owns one training session at a time (one run): a placement group
of `cluster.num_workers` bundles and one LearnerWorker per bundle, forming a
torch.distributed group (gloo on CPU, NCCL on GPU). Calls are serialised.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from dataclasses import dataclass
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
from rlserve.rpc import RpcError, aborted, grpc_method, invalid_argument, not_found
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
class Session:
    run_id: str
    spec: RunSpec
    pg: object
    workers: list
    rendezvous: Path
    version: int = 0
    # (version before, response) of the last step, to answer a retried step without training twice.
    last_step: tuple[int, learner_pb2.TrainStepResponse] | None = None


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


@serve.deployment(max_ongoing_requests=8)
class Learner:
    def __init__(self, args: dict | None = None):
        setup_logging()
        cpu_affinity.pin_from_env()
        self.args = LearnerArgs.model_validate(args or {})
        self.paths = self.args.paths.policy()
        self.session: Session | None = None
        self.lock = asyncio.Lock()

    def _teardown(self) -> None:
        if self.session is None:
            return
        for w in self.session.workers:
            ray.kill(w)
        remove_placement_group(self.session.pg)
        self.session.rendezvous.unlink(missing_ok=True)
        self.session = None

    def _require(self, run_id: str) -> Session:
        if self.session is None:
            raise aborted(f"the learner holds no training session for run {run_id!r} (never configured, a "
                          f"worker died or the replica restarted); call Configure and restore a checkpoint")
        if run_id != self.session.run_id:
            raise not_found(f"run {run_id!r} is not configured on this learner (it serves {self.session.run_id!r})")
        return self.session

    async def _all(self, refs: list) -> list:
        try:
            return await asyncio.gather(*refs)
        except ray.exceptions.RayActorError as err:
            self._teardown()
            raise aborted(f"a learner worker died ({err.__class__.__name__}); its training session is gone: "
                          f"call Configure and restore a checkpoint") from None
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if isinstance(err.cause, Exception) else err
            if isinstance(cause, (ValueError, SpecError)):
                raise invalid_argument("request", str(cause).splitlines()[0]) from None
            raise

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

    @grpc_method
    async def Configure(self, request: learner_pb2.ConfigureRequest) -> learner_pb2.ConfigureResponse:
        if not request.run_id:
            raise invalid_argument("run_id", "required")
        try:
            spec = load_spec(request.spec_yaml)
        except SpecError as err:
            raise invalid_argument(f"spec_yaml: {err.first_path}", "; ".join(err.problems)) from None
        model_path, init_adapter = self._initial_policy(request.init_model_path, spec)
        cl = spec.cluster
        async with self.lock:
            self._teardown()
            t0 = time.perf_counter()
            pg = placement_group([{"CPU": cl.cpus_per_worker, "GPU": cl.gpus_per_worker}] * cl.num_workers,
                                 strategy="PACK")
            try:
                await asyncio.wait_for(pg.ready(), self.args.placement_timeout_s)
            except asyncio.TimeoutError:
                remove_placement_group(pg)
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"no room for {cl.num_workers} learner workers of {cl.cpus_per_worker} CPU / "
                               f"{cl.gpus_per_worker} GPU within {self.args.placement_timeout_s:.0f}s") from None
            rendezvous = Path(tempfile.mkdtemp(prefix="rlserve-learner-")) / "rendezvous"
            workers = [LearnerWorker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                num_cpus=cl.cpus_per_worker, num_gpus=cl.gpus_per_worker,
                # The service's cpu_cores (if any) carry on to its workers.
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(min(cl.torch_threads, os.cpu_count() or 1)),
                                          cpu_affinity.ENV: os.environ.get(cpu_affinity.ENV, "")}},
            ).remote(i, cl.num_workers, f"file://{rendezvous}", cl.device, cl.torch_threads)
                for i in range(cl.num_workers)]
            self.session = Session(request.run_id, spec, pg, workers, rendezvous)
            infos = await self._all([w.configure.remote(request.spec_yaml, str(model_path), init_adapter)
                                     for w in workers])
            info = infos[0]
            event(log, "learner.configured", run=request.run_id, backend=info.backend, layout=info.parallel_layout,
                  params=info.num_parameters, device=info.device, seconds=time.perf_counter() - t0)
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
        async with self.lock:
            session = self._require(request.run_id)
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
            results = await self._all([w.train_step.remote(ref, loss_name, lr) for w in session.workers])
            response = learner_pb2.TrainStepResponse(weight_version=results[0].version, metrics=results[0].metrics)
            session.last_step = (session.version, response)
            session.version = results[0].version
            return response

    @grpc_method
    async def ExportWeights(self, request: learner_pb2.ExportWeightsRequest) -> learner_pb2.ExportWeightsResponse:
        store = request.store_name or self.args.weight_store
        async with self.lock:
            session = self._require(request.run_id)
            results = await self._all([w.export.remote(request.run_id, store, request.direct, request.in_flight,
                                                        self.args.weight_transfer_timeout_s) for w in session.workers])
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
        async with self.lock:
            session = self._require(request.run_id)
            await self._all([w.save_checkpoint.remote(str(path)) for w in session.workers])
            if hf_path is not None:
                await self._all([w.save_hf.remote(str(hf_path)) for w in session.workers])
            version = (await self._all([session.workers[0].version.remote()]))[0]
            return learner_pb2.SaveCheckpointResponse(path=str(path), weight_version=version)

    @grpc_method
    async def LoadCheckpoint(self, request: learner_pb2.LoadCheckpointRequest
                             ) -> learner_pb2.LoadCheckpointResponse:
        path = self.paths.run_path("path", request.path)
        if not is_checkpoint(path):
            raise invalid_argument("path", f"{request.path[:200]} is not a learner checkpoint")
        async with self.lock:
            session = self._require(request.run_id)
            versions = await self._all([w.load_checkpoint.remote(str(path)) for w in session.workers])
            session.version, session.last_step = versions[0], None
            return learner_pb2.LoadCheckpointResponse(weight_version=versions[0])

    @grpc_method
    async def ReleaseSession(self, request: learner_pb2.ReleaseSessionRequest) -> learner_pb2.ReleaseSessionResponse:
        async with self.lock:
            if self.session is None or self.session.run_id != request.run_id:
                return learner_pb2.ReleaseSessionResponse(released=False)
            self._teardown()
            event(log, "learner.released", run=request.run_id)
            return learner_pb2.ReleaseSessionResponse(released=True)


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.learner.app:build`)."""
    return build_app(Learner, LearnerArgs, args)

