"""The rollout Serve application: `rlserve.v1.Rollout` over a vLLM or transformers engine.

Requests are served one at a time per replica (the engine is not re-entrant):
a weight update waits for the generation in progress and the next
generation waits for the update, so every sample comes from exactly one
weight version, which the response names.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path

import ray
import torch
from pydantic import BaseModel, ConfigDict
from ray import serve

from rlserve.cluster.deployment import build_app
from rlserve.logs import event, setup_logging
from rlserve.models import resolve_model
from rlserve.rollout import make_engine
from rlserve.config.spec import MAX_GENERATIONS_PER_PROMPT
from rlserve.rollout.interfaces import EngineConfig, InvalidRequest, SamplingSpec
from rlserve.rpc import RpcError, failed_precondition, grpc_method, invalid_argument, unavailable
from rlserve.security.paths import PathsArgs
from rlserve.v1 import common_pb2, rollout_pb2
from rlserve.weights.specs import TensorSpec, check_update, checkpoint_specs, fingerprint
from rlserve.weights.store import DEFAULT_STORE_NAME, Publication, get_store

log = logging.getLogger("rlserve.rollout")

_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT}


class RolloutArgs(BaseModel):
    """Deploy-time arguments (from cluster.yaml through the Serve config)."""

    model_config = ConfigDict(extra="forbid")

    engine: str = "vllm"
    model: str = "preset:tiny"
    model_seed: int = 0
    dtype: str = "float32"
    max_model_len: int = 256
    kv_cache_gb: float = 1.0
    seed: int = 0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    weight_store: str = DEFAULT_STORE_NAME
    # UpdateWeights from a folder reads only inside the model directories and the runs directory.
    paths: PathsArgs = PathsArgs()
    # Bounds of one Generate request.
    max_prompts: int = 100_000
    max_samples: int = MAX_GENERATIONS_PER_PROMPT


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingSpec:
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise invalid_argument("sampling.temperature", f"must be a finite number >= 0, got {p.temperature}")
    if not 0 <= p.top_p <= 1:
        raise invalid_argument("sampling.top_p", f"must be in [0, 1], got {p.top_p}")
    if p.max_new_tokens <= 0:
        raise invalid_argument("sampling.max_new_tokens", f"must be > 0, got {p.max_new_tokens}")
    return SamplingSpec(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k if p.top_k > 0 else None,
        max_new_tokens=p.max_new_tokens,
        stop_strings=tuple(p.stop_strings),
        stop_token_ids=tuple(p.stop_token_ids),
        seed=p.seed if p.HasField("seed") else None,
    )


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=16)
class Rollout:
    def __init__(self, args: dict | None = None):
        setup_logging()
        self.args = RolloutArgs.model_validate(args or {})
        self.paths = self.args.paths.policy()
        model_path = resolve_model(self.args.model, self.args.model_seed)
        self.engine = make_engine(self.args.engine, EngineConfig(
            model_path=model_path, dtype=self.args.dtype, max_model_len=self.args.max_model_len,
            seed=self.args.seed, tensor_parallel_size=self.args.tensor_parallel_size,
            gpu_memory_utilization=self.args.gpu_memory_utilization, kv_cache_gb=self.args.kv_cache_gb))
        self.specs = checkpoint_specs(model_path)
        self.fingerprint = fingerprint(self.specs)
        self.info = self.engine.info()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.store = get_store(self.args.weight_store)
        self.lock = asyncio.Lock()
        self.publish_id = 0
        self.run_id = ""
        self.version = 0
        # A (re)started replica catches up with the newest publication before serving.
        latest = ray.get(self.store.latest.remote())
        if latest is not None:
            try:
                self._apply(latest)
            except RpcError as err:  # serve the deployed weights until the next publication
                self.publish_id = latest.publish_id
                event(log, "rollout.publication_unusable", logging.WARNING, replica=self.replica_id,
                      version=latest.version, error=err.message)
        event(log, "rollout.ready", replica=self.replica_id, engine=self.info.engine, model=self.info.model,
              version=self.version, fingerprint=self.fingerprint)

    # --- weights -----------------------------------------------------------

    def _fetch(self, pub: Publication) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for bucket in ray.get(pub.bucket_refs):
            tensors.update(bucket)
        return tensors

    def _apply(self, pub: Publication) -> rollout_pb2.UpdateWeightsResponse:
        """Fetch, validate, then load one publication; the old weights keep serving on any error."""
        t0 = time.perf_counter()
        if pub.safetensors_path:
            got = checkpoint_specs(pub.safetensors_path)
            tensors = None
        else:
            try:
                tensors = self._fetch(pub)
            except ray.exceptions.RayError as err:
                raise unavailable(f"weights of version {pub.version} are no longer in the object store "
                                  f"(the learner that published them is gone): {type(err).__name__}") from None
            got = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in tensors.items()}
        problems = check_update(self.specs, got)
        if problems:
            raise invalid_argument("weights", "; ".join(problems[:5]))
        t1 = time.perf_counter()
        try:
            if tensors is None:
                self.engine.load_weights_from_path(Path(pub.safetensors_path))
            else:
                self.engine.load_weights(tensors.items())
        except ValueError as err:
            raise failed_precondition(str(err)) from None
        t2 = time.perf_counter()
        self.publish_id, self.run_id, self.version = pub.publish_id, pub.run_id, pub.version
        event(log, "rollout.weights_applied", replica=self.replica_id, run=pub.run_id or None,
              version=pub.version, tensors=len(got), fetch_s=t1 - t0, apply_s=t2 - t1)
        return rollout_pb2.UpdateWeightsResponse(
            weight_version=pub.version, num_tensors=len(got), num_bytes=pub.num_bytes,
            fetch_seconds=t1 - t0, apply_seconds=t2 - t1, replica_id=self.replica_id)

    async def _sync(self) -> None:
        """Bring this replica to the newest publication (caller holds the lock)."""
        head = await self.store.head.remote()
        if head is not None and head[0] > self.publish_id:
            pub = await self.store.latest.remote()
            await asyncio.to_thread(self._apply, pub)

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
        sampling = sampling_from_proto(request.sampling)
        if not 0 <= request.num_samples <= self.args.max_samples:
            raise invalid_argument("num_samples", f"must be in 0..{self.args.max_samples}, got {request.num_samples}")
        prompts = self._prompts(request, sampling.max_new_tokens)
        n = request.num_samples or 1
        async with self.lock:
            await self._sync()
            if request.run_id and self.run_id and request.run_id != self.run_id:
                raise failed_precondition(f"this rollout serves the weights of run {self.run_id!r}, "
                                          f"not {request.run_id!r}")
            if self.version < request.min_weight_version:
                raise failed_precondition(f"weight version {request.min_weight_version} is not published "
                                          f"(newest: {self.version})")
            version = self.version
            t0 = time.perf_counter()
            try:
                outputs = await asyncio.to_thread(self.engine.generate, prompts, n, sampling)
            except InvalidRequest as err:  # the engine's own validation: the caller's mistake, not retried
                raise invalid_argument("sampling", str(err)) from None
            engine_seconds = time.perf_counter() - t0
        completions = [
            rollout_pb2.Completion(prompt_token_ids=ids, samples=[
                rollout_pb2.Sample(token_ids=s.token_ids, logprobs=s.logprobs,
                                   finish_reason=_FINISH[s.finish_reason], text=s.text) for s in samples])
            for ids, samples in zip(prompts, outputs)]
        return rollout_pb2.GenerateResponse(completions=completions, weight_version=version,
                                            replica_id=self.replica_id, engine_seconds=engine_seconds)

    @grpc_method
    async def UpdateWeights(self, request: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        source = request.WhichOneof("source")
        if source is None:
            raise invalid_argument("source", "give store_name or safetensors_path")
        async with self.lock:
            if source == "safetensors_path":
                path = self.paths.model("safetensors_path", request.safetensors_path)
                if not any(path.glob("*.safetensors")):
                    raise invalid_argument("safetensors_path", f"{path}: no *.safetensors files")
                if request.version <= self.version and not request.force:
                    raise invalid_argument("version", f"{request.version} is not newer than the served "
                                                      f"{self.version} (set force to load it anyway)")
                problems = check_update(self.specs, checkpoint_specs(path))
                if problems:
                    raise invalid_argument("safetensors_path", "; ".join(problems[:5]))
                # Published, so that every replica (not only this one) moves to it.
                num_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
                await self.store.publish.remote(self.run_id, request.version, [], len(self.specs), num_bytes,
                                                str(path))
            else:
                if request.store_name != self.args.weight_store:
                    raise invalid_argument("store_name", f"this rollout follows store {self.args.weight_store!r}")
            pub = await self.store.latest.remote()
            if pub is None or pub.version != request.version:
                have = "nothing" if pub is None else f"version {pub.version}"
                raise failed_precondition(f"version {request.version} is not the newest publication ({have})")
            if pub.publish_id == self.publish_id:
                return rollout_pb2.UpdateWeightsResponse(weight_version=self.version, replica_id=self.replica_id)
            return await asyncio.to_thread(self._apply, pub)

    @grpc_method
    async def GetInfo(self, request: rollout_pb2.GetInfoRequest) -> rollout_pb2.GetInfoResponse:
        del request
        async with self.lock:
            await self._sync()
            return rollout_pb2.GetInfoResponse(
                model=self.info.model, engine=self.info.engine, weight_version=self.version,
                max_model_len=self.info.max_model_len, vocab_size=self.info.vocab_size,
                replica_id=self.replica_id, architecture_fingerprint=self.fingerprint, dtype=self.info.dtype)


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.rollout.app:build`)."""
    return build_app(Rollout, RolloutArgs, args)


app = build({})
