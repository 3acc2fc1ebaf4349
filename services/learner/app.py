"""The learner Serve application: `rlserve.v1.Learner` over the runs' training sessions.

Each RPC decodes its request, calls the session table (`rlserve.learner.sessions`:
sessions, worker groups, fair-share turns, healing, snapshots) and encodes
the answer. The workers are Ray actors in placement groups
(`rlserve.learner.ray_group`), each rank a `rlserve.learner.worker_host.WorkerHost`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import ray
from pydantic import BaseModel, ConfigDict
from ray import serve

from rlserve import cpu_affinity
from rlserve.algorithms.registry import LOSSES, make_loss
from rlserve.cluster.deployment import build_app
from rlserve.config import RunSpec, SpecError, load_spec
from rlserve.learner import primitives_proto
from rlserve.learner.checkpoint import is_checkpoint
from rlserve.learner.ray_group import RayWorkerGroup
from rlserve.learner.sessions import SessionTable
from rlserve.logs import setup_logging
from rlserve.models import resolve_model
from rlserve.rpc import grpc_method, invalid_argument
from rlserve.security.paths import PathsArgs
from rlserve.training.batch import TrainBatch
from rlserve.v1 import learner_pb2
from rlserve.weights import adapter
from rlserve.weights.store import DEFAULT_STORE_NAME


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


def spec_from_proto(request: learner_pb2.ConfigureRequest) -> RunSpec:
    """The run spec a gRPC caller sends as YAML."""
    try:
        return load_spec(request.spec_yaml)
    except SpecError as err:
        raise invalid_argument(f"spec_yaml: {err.first_path}", "; ".join(err.problems)) from None


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
        self.sessions = SessionTable(partial(RayWorkerGroup.start, placement_timeout_s=self.args.placement_timeout_s))

    def _initial_policy(self, init_model_path: str, spec: RunSpec) -> tuple[Path, Path | None]:
        """(the model folder, the PEFT adapter folder to start LoRA adapters from or None). `init_model_path`
        names an HF folder, or with LoRA an adapter folder (the run's SFT warm start) for the spec's base."""
        field = "init_model_path" if init_model_path else "spec_yaml: policy.model_name"
        init_adapter = None
        # An adapter folder holds no config.json, so it is told apart before the check for an HF folder (a
        # Tinker model started from a saved state reaches the learner this way).
        if init_model_path and not init_model_path.startswith("preset:"):
            folder = self.paths.model(field, init_model_path)
            if adapter.is_adapter_folder(folder):
                if not spec.policy.lora.enabled:
                    raise invalid_argument(field, f"{init_model_path[:200]} is a LoRA adapter; the run trains "
                                                  f"without LoRA")
                init_adapter, field, init_model_path = folder, "spec_yaml: policy.model_name", ""
            elif not (folder / "config.json").is_file():
                raise invalid_argument(field, f"{init_model_path[:200]!r} is neither an HF model folder (no "
                                              f"config.json) nor a LoRA adapter folder (no {adapter.CONFIG_FILE})")
        name = self.paths.model_name(field, init_model_path or spec.policy.model_name)
        try:
            return resolve_model(name, spec.policy.model_seed), init_adapter
        except ValueError as err:
            raise invalid_argument(field, str(err)) from None

    @grpc_method
    async def Configure(self, request: learner_pb2.ConfigureRequest,
                        spec: RunSpec | None = None) -> learner_pb2.ConfigureResponse:
        """Inside the cluster the coordinator passes the run's resolved `spec`; gRPC callers send `spec_yaml`."""
        if not request.run_id:
            raise invalid_argument("run_id", "required")
        spec = spec if spec is not None else spec_from_proto(request)
        model_path, init_adapter = self._initial_policy(request.init_model_path, spec)
        info = await self.sessions.configure(request.run_id, spec, model_path, init_adapter, request.shared_base)
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
        spec = self.sessions.session(request.run_id).spec
        loss_name = request.loss_name or spec.loss_fn.name
        if batch_refs:
            batch = batch_refs[0]
        else:  # once into the object store, not once per worker
            batch = ray.put(batch_from_proto(request, make_loss(loss_name, spec.loss_fn).needs_generator_logprobs))
        expected = request.expected_weight_version if request.HasField("expected_weight_version") else None
        result = await self.sessions.train_step(request.run_id, batch, loss_name, lr, expected)
        return learner_pb2.TrainStepResponse(weight_version=result.version, metrics=result.metrics)

    @grpc_method
    async def ExportWeights(self, request: learner_pb2.ExportWeightsRequest) -> learner_pb2.ExportWeightsResponse:
        out = await self.sessions.export(request.run_id, request.store_name or self.args.weight_store,
                                         request.direct, request.in_flight, self.args.weight_transfer_timeout_s,
                                         request.shared_base)
        return learner_pb2.ExportWeightsResponse(
            weight_version=out.version, num_buckets=out.num_buckets, num_tensors=out.num_tensors,
            num_bytes=out.num_bytes, seconds=out.seconds, direct_bytes=out.direct_bytes,
            receivers=out.receivers, failed=out.failures, model_bytes=out.model_bytes,
            direct_seconds=out.direct_seconds, store_seconds=out.store_seconds)

    @grpc_method
    async def SaveCheckpoint(self, request: learner_pb2.SaveCheckpointRequest
                             ) -> learner_pb2.SaveCheckpointResponse:
        if not request.path:
            raise invalid_argument("path", "required")
        path = self.paths.run_path("path", request.path)
        hf_path = self.paths.run_path("hf_path", request.hf_path) if request.hf_path else None
        version = await self.sessions.save_checkpoint(request.run_id, path, hf_path)
        return learner_pb2.SaveCheckpointResponse(path=str(path), weight_version=version)

    @grpc_method
    async def LoadCheckpoint(self, request: learner_pb2.LoadCheckpointRequest
                             ) -> learner_pb2.LoadCheckpointResponse:
        path = self.paths.run_path("path", request.path)
        if not is_checkpoint(path):
            raise invalid_argument("path", f"{request.path[:200]} is not a learner checkpoint")
        version = await self.sessions.load_checkpoint(request.run_id, path)
        return learner_pb2.LoadCheckpointResponse(weight_version=version)

    @grpc_method
    async def Forward(self, request: learner_pb2.ForwardRequest) -> learner_pb2.ForwardResponse:
        """`forward`, or with `backward` `forward_backward` (gradients kept until OptimStep), of the run's datums."""
        try:
            batch = primitives_proto.batch_from_proto(request)
        except ValueError as err:
            field, _, problem = str(err).partition(": ")
            raise invalid_argument(field, problem) from None
        result = await self.sessions.forward_primitive(request.run_id, batch, request.backward)
        return primitives_proto.forward_response(result)

    @grpc_method
    async def OptimStep(self, request: learner_pb2.OptimStepRequest) -> learner_pb2.OptimStepResponse:
        try:
            step = primitives_proto.adam_from_proto(request)
        except ValueError as err:
            field, _, problem = str(err).partition(": ")
            raise invalid_argument(field, problem) from None
        return primitives_proto.optim_response(await self.sessions.optim_step(request.run_id, step))

    @grpc_method
    async def ReleaseSession(self, request: learner_pb2.ReleaseSessionRequest) -> learner_pb2.ReleaseSessionResponse:
        return learner_pb2.ReleaseSessionResponse(released=await self.sessions.release(request.run_id))


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.learner.app:build`)."""
    return build_app(Learner, LearnerArgs, args)
