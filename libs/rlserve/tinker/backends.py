"""What the Tinker API trains, samples and meters on, as three small protocols, and their implementations
over rlserve's own parts.

- `Trainer`: the learner's primitives for a model's session. `ServiceTrainer` calls the learner service
  (its Configure, Forward, OptimStep, SaveCheckpoint, LoadCheckpoint, ReleaseSession) through typed
  callables (`LearnerCalls`: the coordinator's Serve handles); `local.TableTrainer` calls a session table
  in process (tests, benchmarks). Either way one model is one learner session, and LoRA adapters of any rank
  share one frozen base per worker layout and take fair turns (`rlserve.learner.sessions`).
- `Sampler`: generation with a saved adapter or the base. `ServiceSampler` calls the rollout service's
  Generate (`RolloutCalls`): the adapter's folder on the deployed base beside other adapters (a replica
  that dropped it loads it again), prompt logprobs in the same call; `local.EngineSampler` drives a synchronous
  engine in process, with `max_adapters` held at once (least recently used dropped first), never an error.
- `ModelRuns`: each model is a run of its user (`rlserve.runs.manager`): queued under the cluster's
  tenancy (the user's quota, the runs that train at once), owned, and metered in `rlserve runs usage`.
  `local.LocalRuns` keeps them in memory (at most `max_models` a user), for a service without a coordinator.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from rlserve.config import RunSpec
from rlserve.learner import primitives_proto
from rlserve.learner.interfaces import StepResult
from rlserve.rollout.interfaces import GeneratedSample, SamplingSpec
from rlserve.security.principal import Principal
from rlserve.training.primitives import AdamStep, DatumBatch, PrimitiveResult
from rlserve.v1 import common_pb2, learner_pb2, rollout_pb2

# Why a model's future waits: the user's quota (the SDK's "paused_rate_limit") or the cluster's capacity.
WaitReason = Literal["quota", "capacity"]


class Trainer(Protocol):
    async def configure(self, run_id: str, spec: RunSpec, base: Path, init_adapter: Path | None) -> int:
        """The model's learner session (from `init_adapter`'s weights, or fresh); its ranks."""
        ...

    async def forward(self, run_id: str, batch: DatumBatch, backward: bool) -> PrimitiveResult: ...

    async def optim_step(self, run_id: str, step: AdamStep) -> StepResult: ...

    async def save(self, run_id: str, path: Path, adapter_path: Path | None) -> None: ...

    async def load(self, run_id: str, path: Path) -> int: ...

    async def release(self, run_id: str) -> None: ...


@dataclass(frozen=True)
class Sampled:
    samples: list[GeneratedSample]
    # With SamplingSpec.prompt_logprobs: each prompt token's after the first, and its most likely tokens.
    prompt_logprobs: list[float] | None
    prompt_top: list[list[tuple[int, float]]] | None
    engine_seconds: float


@dataclass(frozen=True)
class Deployment:
    """What the cluster's rollout serves: the model adapters apply to, and its LoRA limits."""

    model: Path
    lora: bool
    max_lora_rank: int


class Sampler(Protocol):
    async def sample(self, run_id: str, priority: float, adapter: Path | None, prompt: list[int], n: int,
                     sampling: SamplingSpec) -> Sampled:
        """`n` samples of `prompt` with the PEFT adapter in `adapter` (None: the base); `run_id` is whose
        request it is in the engines' fair share."""
        ...


class ModelRuns(Protocol):
    async def open(self, caller: Principal, run_id: str, spec: RunSpec, body: Callable[[], Awaitable[None]],
                   waiting: Callable[[WaitReason, str], None]) -> None:
        """The model's run, started: queued under the tenancy (`waiting(reason, message)` each time it waits),
        then `body` runs as the run until the model ends; returns once `body` started. Raises `UserError`
        or the cluster's `RpcError` when the run cannot be, and cancels a queued run when cancelled."""
        ...

    def meter(self, run_id: str, usage: dict[str, float], version: int | None) -> None:
        """What the model spent since the last call (`usage/*` metrics); with `version`, at an optimizer step
        that reached it."""
        ...


# --- on a cluster -------------------------------------------------------------------------------------


class LearnerCalls(Protocol):
    """The learner service's RPCs the Tinker API calls (the coordinator's Serve handles); a failure raises the
    service's `RpcError`."""

    async def configure(self, req: learner_pb2.ConfigureRequest, spec: RunSpec) -> learner_pb2.ConfigureResponse: ...

    async def forward(self, req: learner_pb2.ForwardRequest) -> learner_pb2.ForwardResponse: ...

    async def optim_step(self, req: learner_pb2.OptimStepRequest) -> learner_pb2.OptimStepResponse: ...

    async def save_checkpoint(self, req: learner_pb2.SaveCheckpointRequest) -> learner_pb2.SaveCheckpointResponse: ...

    async def load_checkpoint(self, req: learner_pb2.LoadCheckpointRequest) -> learner_pb2.LoadCheckpointResponse: ...

    async def release_learner(self, run_id: str) -> None: ...


class RolloutCalls(Protocol):
    async def generate(self, req: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse: ...

    async def rollout_info(self) -> rollout_pb2.GetInfoResponse: ...


class ServiceTrainer:
    """The learner service: a model's session is a LoRA session on the deployed base (`shared_base`)."""

    def __init__(self, learner: LearnerCalls):
        self.learner = learner

    async def configure(self, run_id: str, spec: RunSpec, base: Path, init_adapter: Path | None) -> int:
        out = await self.learner.configure(learner_pb2.ConfigureRequest(
            run_id=run_id, init_model_path=str(init_adapter) if init_adapter else "", shared_base=True), spec)
        return out.world_size

    async def forward(self, run_id: str, batch: DatumBatch, backward: bool) -> PrimitiveResult:
        out = await self.learner.forward(primitives_proto.forward_request(run_id, batch, backward))
        return primitives_proto.result_from_proto(out)

    async def optim_step(self, run_id: str, step: AdamStep) -> StepResult:
        return primitives_proto.step_from_proto(await self.learner.optim_step(
            primitives_proto.optim_request(run_id, step)))

    async def save(self, run_id: str, path: Path, adapter_path: Path | None) -> None:
        await self.learner.save_checkpoint(learner_pb2.SaveCheckpointRequest(
            run_id=run_id, path=str(path), hf_path=str(adapter_path) if adapter_path else ""))

    async def load(self, run_id: str, path: Path) -> int:
        return (await self.learner.load_checkpoint(learner_pb2.LoadCheckpointRequest(
            run_id=run_id, path=str(path)))).weight_version

    async def release(self, run_id: str) -> None:
        await self.learner.release_learner(run_id)


def sampling_proto(s: SamplingSpec) -> common_pb2.SamplingParams:
    out = common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0,
                                    max_new_tokens=s.max_new_tokens, min_new_tokens=s.min_new_tokens,
                                    stop_strings=s.stop_strings, stop_token_ids=s.stop_token_ids,
                                    top_logprobs=s.top_logprobs)
    if s.seed is not None:
        out.seed = s.seed
    if s.prompt_logprobs is not None:
        out.prompt_logprobs = s.prompt_logprobs
    return out


_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort"}


def _rows(tops) -> list[list[tuple[int, float]]]:
    return [list(zip(t.token_ids, t.logprobs)) for t in tops]


class ServiceSampler:
    """The rollout service: a saved adapter's folder (`GenerateRequest.adapter_path`) or the deployed base."""

    def __init__(self, rollout: RolloutCalls):
        self.rollout = rollout

    async def deployment(self) -> Deployment:
        info = await self.rollout.rollout_info()
        return Deployment(Path(info.model), info.lora_enabled, info.max_lora_rank)

    async def sample(self, run_id: str, priority: float, adapter: Path | None, prompt: list[int], n: int,
                     sampling: SamplingSpec) -> Sampled:
        out = await self.rollout.generate(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=prompt))], num_samples=n,
            sampling=sampling_proto(sampling), run_id=run_id, priority=priority,
            adapter_path=str(adapter) if adapter is not None else "", deployed_base=adapter is None))
        completion = out.completions[0]
        samples = [GeneratedSample(list(s.token_ids), list(s.logprobs), _FINISH.get(s.finish_reason, "stop"), s.text,
                                   top_logprobs=tuple(tuple(r) for r in _rows(s.top_logprobs)) if s.top_logprobs
                                   else None)
                   for s in completion.samples]
        asked = sampling.prompt_logprobs is not None
        return Sampled(samples, list(completion.prompt_logprobs) if asked else None,
                       _rows(completion.prompt_top_logprobs) if asked and sampling.prompt_logprobs else None,
                       out.engine_seconds)
