"""The rollout Serve application: `rlserve.v1.Rollout` over a vLLM or transformers engine.

A replica serves many requests at once (vLLM's AsyncLLM schedules them;
the transformers engine takes them in turn). Runs sharing it get their
priority's share of its sequences, counted in tokens
(`rlserve.rollout.fair_generation`). New weights arrive while they
run: straight from the learner through vLLM's weight-transfer API, or from
the weight store (`rlserve.rollout.follower`). Each sample names the weight
versions that generated its tokens.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

from pydantic import Field
from ray import serve

from rlserve.cluster.deployment import assigned_device, build_app
from rlserve.config.section import MAX_PRIORITY
from rlserve.config.spec import MAX_GENERATIONS_PER_PROMPT
from rlserve.cpu_affinity import place_from_env
from rlserve.logs import event, setup_logging
from rlserve.models import resolve_model
from rlserve.rollout import make_engine
from rlserve.rollout.adapters import RunAdapters
from rlserve.rollout.fair_generation import FairGeneration
from rlserve.rollout.follower import WeightFollower
from rlserve.rollout.interfaces import EngineConfig, EngineSettings, InvalidRequest, RunAdapter, SamplingSpec
from rlserve.rollout.samples import completions_proto
from rlserve.rpc import aborted, failed_precondition, grpc_method, invalid_argument
from rlserve.security.paths import PathsArgs
from rlserve.v1 import common_pb2, rollout_pb2
from rlserve.weights.fleet import get_fleet
from rlserve.weights.specs import checkpoint_specs, fingerprint
from rlserve.weights.store import DEFAULT_STORE_NAME, get_store

log = logging.getLogger("rlserve.rollout")
# Most likely tokens a request may ask for per position (prompt or sampled).
MAX_TOP_LOGPROBS = 20


class RolloutArgs(EngineSettings):
    """Deploy-time arguments (from the cluster file through the Serve config)."""

    engine: str = "vllm"
    model: str = "preset:tiny"
    model_seed: int = 0
    weight_store: str = DEFAULT_STORE_NAME
    # A direct weight transfer that stalls this long is abandoned (the old weights keep serving).
    weight_transfer_timeout_s: float = 120.0
    # UpdateWeights from a folder reads only inside the model directories and the runs directory.
    paths: PathsArgs = PathsArgs()
    # Bounds of one Generate request.
    max_prompts: int = 100_000
    max_samples: int = MAX_GENERATIONS_PER_PROMPT
    # Runs' adapters (shared_base runs) a replica holds at once; the least recently used idle one goes
    # first and is loaded again on its run's next request.
    max_run_adapters: int = Field(64, ge=1, le=4096)


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingSpec:
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise invalid_argument("sampling.temperature", f"must be a finite number >= 0, got {p.temperature}")
    if not 0 <= p.top_p <= 1:
        raise invalid_argument("sampling.top_p", f"must be in [0, 1], got {p.top_p}")
    if p.max_new_tokens <= 0:
        raise invalid_argument("sampling.max_new_tokens", f"must be > 0, got {p.max_new_tokens}")
    if not 0 <= p.min_new_tokens <= p.max_new_tokens:
        raise invalid_argument("sampling.min_new_tokens", f"must be in [0, max_new_tokens], got {p.min_new_tokens}")
    if p.HasField("prompt_logprobs") and not 0 <= p.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid_argument("sampling.prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {p.prompt_logprobs}")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid_argument("sampling.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}")
    return SamplingSpec(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k if p.top_k > 0 else None,
        max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        stop_strings=tuple(p.stop_strings),
        stop_token_ids=tuple(p.stop_token_ids),
        seed=p.seed if p.HasField("seed") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        top_logprobs=p.top_logprobs,
    )


@serve.deployment(max_ongoing_requests=1024)
class Rollout:
    async def __init__(self, args: dict | None = None):
        setup_logging()
        place_from_env()
        self.args = RolloutArgs.model_validate(args or {})
        self.paths = self.args.paths.policy()
        model_path = resolve_model(self.args.model, self.args.model_seed)
        settings = self.args.model_dump(include=set(EngineSettings.model_fields))
        self.device = assigned_device()
        self.engine = make_engine(self.args.engine, EngineConfig(model_path=model_path, device=self.device, **settings))
        specs = checkpoint_specs(model_path)
        self.fingerprint = fingerprint(specs)
        self.info = self.engine.info()
        self.generation = FairGeneration(self.engine)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.weights = WeightFollower(get_store(self.args.weight_store), get_fleet(self.args.weight_store),
                                      self.engine, specs, self.replica_id, self.args.weight_transfer_timeout_s,
                                      lambda base: self.paths.model("base_model_name_or_path", base))
        await self.weights.start()
        self.adapters = RunAdapters(get_store(self.args.weight_store), self.engine, self.weights.check_run_adapter,
                                    self.replica_id, self.args.max_run_adapters)
        event(log, "rollout.ready", replica=self.replica_id, engine=self.info.engine, model=self.info.model,
              device=self.device,
              version=self.weights.version, fingerprint=self.fingerprint,
              weight_transfer=self.engine.transfer_backend or "none")

    def _activity(self) -> rollout_pb2.EngineActivity:
        s = self.engine.stats()
        return rollout_pb2.EngineActivity(uptime_s=s.uptime_s, idle_s=s.idle_s, paused_s=s.paused_s,
                                          requests_running=s.requests_running, generated_tokens=s.generated_tokens)

    # --- RPCs --------------------------------------------------------------

    def _prompts(self, request: rollout_pb2.GenerateRequest, max_new_tokens: int) -> list[list[int]]:
        if not request.prompts:
            raise invalid_argument("prompts", "empty request: give at least one prompt")
        if len(request.prompts) > self.args.max_prompts:
            raise invalid_argument("prompts", f"{len(request.prompts)} prompts; at most {self.args.max_prompts} "
                                              f"in one request")
        prompts = []
        for i, p in enumerate(request.prompts):
            kind = p.WhichOneof("content")
            ids = list(p.token_ids.ids) if kind == "token_ids" else self.engine.encode(p.text) if kind else []
            if not ids:
                raise invalid_argument(f"prompts[{i}]", "empty prompt")
            bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise invalid_argument(f"prompts[{i}].token_ids", f"ids {bad[:3]} outside the vocabulary "
                                                                   f"(size {self.info.vocab_size})")
            if len(ids) + max_new_tokens > self.info.max_model_len:
                raise invalid_argument(f"prompts[{i}]", f"{len(ids)} prompt tokens + max_new_tokens "
                                       f"{max_new_tokens} exceed the model length {self.info.max_model_len}")
            prompts.append(ids)
        return prompts

    @grpc_method
    async def Generate(self, request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        sampling = replace(sampling_from_proto(request.sampling), routed_experts=request.routed_experts)
        if request.routed_experts and self.engine.routing_unavailable:
            raise failed_precondition(f"routed_experts: the {self.info.engine} engine cannot record MoE routing "
                                      f"({self.engine.routing_unavailable})")
        if not 0 <= request.num_samples <= self.args.max_samples:
            raise invalid_argument("num_samples", f"must be in 0..{self.args.max_samples}, got {request.num_samples}")
        if not 0 <= request.priority <= MAX_PRIORITY:
            raise invalid_argument("priority", f"must be in (0, {MAX_PRIORITY:g}] (0: 1), got {request.priority}")
        prompts = self._prompts(request, sampling.max_new_tokens)
        n = request.num_samples or 1
        if request.adapter_path or request.deployed_base:
            return await self._generate_on_deployed_base(request, prompts, n, sampling)
        if request.shared_base:
            return await self._generate_with_run_adapter(request, prompts, n, sampling)
        await self.weights.sync(request.min_weight_version)
        served = self.weights.run_id
        if request.run_id and served and request.run_id != served:
            raise failed_precondition(f"this rollout serves the weights of run {served!r}, "
                                      f"not {request.run_id!r}")
        version = self.weights.version
        if version < request.min_weight_version:
            # The run's weights are gone from here (the weight store was lost): the caller must
            # publish them again, which retrying this call cannot do.
            raise aborted(f"weight version {request.min_weight_version} is not published (this replica "
                          f"serves {version})")
        return await self._generate(request, prompts, n, sampling, None)

    async def _generate_with_run_adapter(self, request: rollout_pb2.GenerateRequest, prompts: list[list[int]],
                                         n: int, sampling: SamplingSpec) -> rollout_pb2.GenerateResponse:
        """On the deployed base with the run's own adapter, beside other runs' (`rlserve.rollout.adapters`)."""
        if not self.args.enable_lora:
            raise failed_precondition("shared_base: this rollout serves without LoRA (enable_lora in its args)")
        if not request.run_id:
            raise invalid_argument("run_id", "required with shared_base")
        ref = await self.adapters.acquire(request.run_id, request.min_weight_version)
        try:
            return await self._generate(request, prompts, n, sampling, ref)
        finally:
            await self.adapters.release(ref)

    async def _generate_on_deployed_base(self, request: rollout_pb2.GenerateRequest, prompts: list[list[int]],
                                         n: int, sampling: SamplingSpec) -> rollout_pb2.GenerateResponse:
        """On the deployed base, with the adapter saved in `adapter_path` (beside other adapters) or none."""
        if request.shared_base or (request.adapter_path and request.deployed_base):
            raise invalid_argument("adapter_path", "one of shared_base, adapter_path and deployed_base")
        if not request.adapter_path:
            await self.engine.use_deployed_base()
            return await self._generate(request, prompts, n, sampling, None)
        if not self.args.enable_lora:
            raise failed_precondition("adapter_path: this rollout serves without LoRA (enable_lora in its args)")
        ref = await self.adapters.acquire_folder(self.paths.run_path("adapter_path", request.adapter_path))
        try:
            return await self._generate(request, prompts, n, sampling, ref)
        finally:
            await self.adapters.release(ref)

    async def _generate(self, request: rollout_pb2.GenerateRequest, prompts: list[list[int]], n: int,
                        sampling: SamplingSpec, adapter: RunAdapter | None) -> rollout_pb2.GenerateResponse:
        t0 = time.perf_counter()
        try:
            outputs = await self.generation.generate(request.run_id, request.priority or 1.0, prompts, n, sampling,
                                                     adapter)
        except InvalidRequest as err:  # the engine's own validation: the caller's mistake, not retried
            raise invalid_argument("sampling", str(err)) from None
        engine_seconds = time.perf_counter() - t0
        completions = completions_proto(prompts, outputs)
        oldest = min(s.oldest_version for samples in outputs for s in samples)
        return rollout_pb2.GenerateResponse(completions=completions, weight_version=oldest,
                                            replica_id=self.replica_id, engine_seconds=engine_seconds,
                                            activity=self._activity())

    @grpc_method
    async def UpdateWeights(self, request: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        source = request.WhichOneof("source")
        if request.shared_base:
            return await self._update_run_adapter(request)
        if source is None:
            raise invalid_argument("source", "give store_name or safetensors_path")
        if source == "safetensors_path":
            folder = self.paths.model("safetensors_path", request.safetensors_path)
            await self.weights.publish_folder(folder, request.version, request.force, request.in_flight)
        elif request.store_name != self.args.weight_store:
            raise invalid_argument("store_name", f"this rollout follows store {self.args.weight_store!r}")
        applied = await self.weights.update_to(request.version, request.in_flight)
        if applied is None:
            return rollout_pb2.UpdateWeightsResponse(weight_version=request.version, replica_id=self.replica_id)
        return rollout_pb2.UpdateWeightsResponse(
            weight_version=applied.version, num_tensors=applied.num_tensors, num_bytes=applied.num_bytes,
            fetch_seconds=applied.fetch_seconds, apply_seconds=applied.apply_seconds, replica_id=self.replica_id)

    async def _update_run_adapter(self, request: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        """Load the run's published adapter on this replica now (the others load it on the run's next request
        there): checks it early and takes the load off the next step's path here."""
        if not self.args.enable_lora:
            raise failed_precondition("shared_base: this rollout serves without LoRA (enable_lora in its args)")
        if not request.run_id:
            raise invalid_argument("run_id", "required with shared_base")
        if request.WhichOneof("source") != "store_name" or request.store_name != self.args.weight_store:
            raise invalid_argument("store_name", f"a run's adapter comes from the weight store "
                                                 f"{self.args.weight_store!r}")
        t0 = time.perf_counter()
        ref = await self.adapters.acquire(request.run_id, request.version)
        await self.adapters.release(ref)
        return rollout_pb2.UpdateWeightsResponse(weight_version=ref.version, replica_id=self.replica_id,
                                                 apply_seconds=time.perf_counter() - t0)

    @grpc_method
    async def GetInfo(self, request: rollout_pb2.GetInfoRequest) -> rollout_pb2.GetInfoResponse:
        version, digests = self.weights.version, {}
        if request.weight_digests:
            try:
                version, digests = await self.engine.weight_digests()
            except NotImplementedError as e:
                raise failed_precondition(f"weight_digests: {e}") from None
        return rollout_pb2.GetInfoResponse(
            model=self.info.model, engine=self.info.engine, weight_version=version, weight_sha256=digests,
            max_model_len=self.info.max_model_len, vocab_size=self.info.vocab_size,
            replica_id=self.replica_id, architecture_fingerprint=self.fingerprint, dtype=self.info.dtype,
            tensor_parallel_size=self.args.tensor_parallel_size,
            gpu_memory_utilization=self.args.gpu_memory_utilization, enforce_eager=self.args.enforce_eager,
            weight_transfer=self.engine.transfer_backend or "", activity=self._activity(),
            run_id=self.weights.run_id, lora_enabled=self.args.enable_lora, max_loras=self.args.max_loras,
            max_lora_rank=self.args.max_lora_rank, routing_unavailable=self.engine.routing_unavailable,
            adapters=[rollout_pb2.RunAdapter(run_id=r, version=v) for r, v in sorted(self.adapters.versions().items())])


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.rollout.app:build`)."""
    return build_app(Rollout, RolloutArgs, args)
