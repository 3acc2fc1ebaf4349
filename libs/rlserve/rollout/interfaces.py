"""The rollout engine contract: what the rollout service needs from vLLM or transformers.

`RolloutEngine` is asynchronous and re-entrant: a replica serves many
requests at once, and a new weight version may arrive while they run. How a
version is applied is the engine's business; what it must report is which
version produced each token (`GeneratedSample.version_runs`), so that
callers can bound staleness by the oldest version in a sample and correct for
it with the recorded logprobs. `BatchEngine` is the simple synchronous form
(one batch at a time); `serialized.Serialized` turns one into a
`RolloutEngine` whose samples each come from one version.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class InvalidRequest(ValueError):
    """The engine's own validation refused a request (vLLM's sampling checks, say): the caller's
    mistake, answered INVALID_ARGUMENT and never retried."""


class EngineSettings(BaseModel):
    """How an engine is started (the rollout app's deploy arguments hold these; defaults live here)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # vLLM: record the experts a MoE model routes each token to (its `enable_return_routed_experts`,
    # Model Runner V2 on GPUs: not on vLLM's CPU backend), for runs with policy.routing_replay. The
    # transformers engine records routing of any MoE model without it.
    routed_experts: bool = False
    max_model_len: int = Field(256, ge=8)
    seed: int = 0
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    enforce_eager: bool = True
    # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE), whole GiB.
    kv_cache_gb: int = Field(1, ge=1)
    # vLLM weight updates: "auto" reloads in place where that is known to be correct (vllm_reload)
    # and rebuilds the engine otherwise; "rebuild" always starts an engine on the new weights (slow).
    weight_reload: Literal["auto", "rebuild"] = "auto"
    # Sequences the engine schedules at once (vLLM's max_num_seqs).
    max_num_seqs: int = Field(256, ge=1)
    # vLLM weight-transfer engine the learner sends new weights through: "gloo" (CPU, registered by
    # rlserve), "nccl" (GPUs on different processes), "ipc" (learner and engine share a GPU; for the
    # transformers engine, rlserve's own same-device handoff, `rlserve.weights.handoff`: CUDA IPC on
    # a GPU, shared memory on the CPU); "none" takes
    # weights only from the weight store (the transformers engine's only other choice: it ignores gloo
    # and nccl).
    weight_transfer: Literal["gloo", "nccl", "ipc", "none"] = "gloo"
    # What an in-flight update does to the requests it lands in: "recompute" their KV cache under
    # the new weights (exact: every token after the switch is the new policy's, at the cost of a
    # prefill of every running sequence per update), or "keep" it (PipelineRL's and vLLM's
    # pause-keep semantics: tokens after the switch attend to keys/values computed by older
    # weights; the recorded logprobs are still the ones sampled, which the IS correction uses).
    in_flight_kv_cache: Literal["recompute", "keep"] = "recompute"
    # vLLM on CPU: the cores its engine process and workers run on (vLLM's OpenMP threads bind to
    # them); empty: vLLM's automatic binding. Give the learner other cores (`services.learner.cpu_cores`)
    # so generation and training overlap instead of contending.
    cpu_cores: tuple[Annotated[int, Field(ge=0)], ...] = Field((), max_length=4096)
    # The transformers engine on the CPU: torch's threads for generation; 0: one per core this
    # replica may run on (Ray's own default is the replica's `num_cpus`, rounded down to at least 1,
    # which left a demo step's generation on one of two idle cores: 0.29 s against 0.22 s on both).
    torch_threads: int = Field(0, ge=0, le=1024)
    # How the transformers engine generates (`rlserve.rollout.hf_generation`): "generate" (transformers
    # `generate`, a dynamic KV cache), "continuous" (continuous batching: a paged KV cache sized for
    # max_num_seqs sequences of max_model_len tokens), "static" (`generate` with a static KV cache, its decode
    # step compiled on a GPU), "compiled" (rlserve's own decode loop over a static cache, its step compiled
    # into CUDA graphs on a GPU), "auto" (compiled on CUDA, the fastest there: 1.92x generate and 1.40x static
    # on an H100; generate on the CPU). LoRA adapters, MoE routing capture and what a fast path cannot sample
    # fall back to generate, with a log line. vLLM ignores it.
    generation: Literal["auto", "generate", "continuous", "static", "compiled"] = "auto"
    # LoRA runs: the deployed model is the base and each run's adapter is served on it (vLLM's
    # enable_lora, max_loras adapters at once, of rank at most max_lora_rank).
    enable_lora: bool = False
    max_loras: int = Field(1, ge=1, le=1024)
    max_lora_rank: int = Field(64, ge=1, le=1024)


class EngineConfig(EngineSettings):
    model_path: Path
    # Where an in-process engine (transformers) runs: "auto" is CUDA when this process sees a GPU.
    # A rollout replica passes the device Ray gave it ("cuda" only with num_gpus > 0). vLLM picks its own.
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Also record the experts a MoE model routed each position to (`GeneratedSample.routed_experts`), for
    # routing replay in the learner; only on an engine that `records_routing`.
    routed_experts: bool = False
    # Also each prompt token's logprob after the first (`GeneratedSample.prompt_logprobs`) and, when > 0,
    # this many most likely tokens at each of those positions; None: none.
    prompt_logprobs: int | None = None
    # With each sampled token, this many most likely tokens at its position (`GeneratedSample.top_logprobs`).
    top_logprobs: int = 0


@dataclass(frozen=True)
class VersionRun:
    """Tokens [start, end) of a sample were generated under weight version `version`."""

    version: int
    start: int
    end: int


@dataclass(frozen=True)
class GeneratedSample:
    token_ids: list[int]
    # Logprob of each sampled token under the model's own (temperature-1) distribution, with the
    # weights that sampled it.
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""
    # Which weight version produced which tokens, in order, covering every token.
    version_runs: tuple[VersionRun, ...] = ()
    # With SamplingSpec.routed_experts: int16 [positions, moe_layers, experts_per_token], the experts of
    # every position of prompt + sample but the last (no forward pass routes the last token).
    routed_experts: torch.Tensor | None = None
    # With SamplingSpec.prompt_logprobs (the same in every sample of a prompt): the logprob of each prompt
    # token after the first under the weights that sampled, and per position its most likely (token, logprob).
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    # With SamplingSpec.top_logprobs: per sampled token, the most likely (token, logprob) at its position.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None

    @property
    def oldest_version(self) -> int:
        return min(r.version for r in self.version_runs)


@dataclass(frozen=True)
class RunAdapter:
    """One version of a run's LoRA adapter on the deployed base (`rlserve.rollout.adapters`), which a
    request names to generate with it, beside other runs' adapters. `adapter_id` is new for every
    loaded version; an engine that does not hold it (never loaded, or evicted) loads it from `folder`.
    Its samples are labelled `version` whatever else the engine loads meanwhile."""

    adapter_id: int
    run_id: str
    version: int
    folder: Path


@dataclass
class EngineInfo:
    engine: str
    model: str
    max_model_len: int
    vocab_size: int
    dtype: str
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStats:
    """Cumulative seconds since the engine started; callers take differences over an interval."""

    uptime_s: float
    # No request in the engine, or all of them held by a pause.
    idle_s: float
    # Paused for a weight update (part of idle_s when requests were waiting).
    paused_s: float
    requests_running: int
    generated_tokens: int = 0  # completion tokens of the requests finished, every run's


class RolloutEngine(ABC):
    """One generation engine serving concurrent requests."""

    name: str
    # The weight-transfer engine name a learner may send to directly, or None (weight store only),
    # and how many ranks (workers) the engine brings to a transfer.
    transfer_backend: str | None = None
    num_transfer_workers: int = 1
    # Sequences the engine generates at once (vLLM's max_num_seqs; 1 for an engine that takes one
    # request at a time): the capacity runs share fairly (`rlserve.tenancy.fair_share`).
    max_running_sequences: int = 1
    # It records MoE routing when asked (`SamplingSpec.routed_experts`); "" if it does, else why not.
    routing_unavailable: str = "the engine records no MoE routing"

    @abstractmethod
    async def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSpec,
                       adapter: RunAdapter | None = None) -> list[list[GeneratedSample]]:
        """`n` samples for each prompt, in prompt order; with `adapter`, on the deployed base with that run's
        adapter (the engine restores the deployed base first if other weights serve), never pausing
        other requests."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The weight version new tokens are generated under."""

    @abstractmethod
    async def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int, in_flight: bool) -> None:
        """Replace weights in place with HF-named full tensors (already validated).

        in_flight: requests running now continue under the new weights (their
        samples then span versions); otherwise they finish on the old weights first.
        """

    @abstractmethod
    async def load_weights_from_path(self, path: Path, version: int, in_flight: bool) -> None:
        """`load_weights` from a folder of HF-named *.safetensors (already validated)."""

    async def load_adapter(self, folder: Path, base: Path, version: int, in_flight: bool) -> None:
        """Serve the PEFT adapter in `folder` (already validated) on the base model in `base` from now on,
        as weight version `version` (replacing the adapter served before; `in_flight` as for weights).
        `base` is the deployed model, or a run's own starting point (its full-parameter SFT warm
        start); the engine loads it first when it serves other weights. The engine owns `folder`
        from then on and removes it once it no longer reads it."""
        raise NotImplementedError(f"the {self.name} engine serves without LoRA (enable_lora in its args)")

    async def drop_adapter(self, adapter_id: int) -> None:
        """Forget a run's adapter version that no request uses any more (its folder stays the caller's)."""

    async def use_deployed_base(self) -> None:
        """Generate requests without an adapter on the deployed model's own weights from now on (restored if a
        run's weights or adapter served), as weight version 0."""
        raise NotImplementedError(f"the {self.name} engine cannot restore the deployed model")

    # vLLM's weight-transfer API, for engines with a `transfer_backend` (the learner drives the calls).
    async def init_weight_transfer(self, init_info: dict) -> None:
        raise NotImplementedError(f"the {self.name} engine takes weights from the weight store only")

    async def start_weight_update(self, in_flight: bool) -> None:
        raise NotImplementedError(f"the {self.name} engine takes weights from the weight store only")

    async def update_weights(self, update_info: dict) -> None:
        raise NotImplementedError(f"the {self.name} engine takes weights from the weight store only")

    async def finish_weight_update(self, version: int, in_flight: bool) -> None:
        raise NotImplementedError(f"the {self.name} engine takes weights from the weight store only")

    async def abort_weight_update(self) -> None:
        raise NotImplementedError(f"the {self.name} engine takes weights from the weight store only")

    async def weight_digests(self) -> tuple[int, dict[str, str]]:
        """The version served and each checkpoint-named weight's digest (`rlserve.weights.digest`), taken
        together: what shows a transfer bit-exact against the learner's export."""
        raise NotImplementedError(f"the {self.name} engine cannot digest its weights (its model runs in a "
                                  f"layout of its own)")

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def info(self) -> EngineInfo: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    async def close(self) -> None:
        """Release the engine (its processes, memory)."""


class BatchEngine(ABC):
    """A synchronous engine: one batch at a time (wrap it in `serialized.Serialized`)."""

    name: str
    # `handoff` where the learner may hand weights over on the engine's own device
    # (`rlserve.weights.handoff`, into `device`); None: the weight store only.
    transfer_backend: str | None = None
    device: torch.device
    # As `RolloutEngine.routing_unavailable`.
    routing_unavailable: str = "the engine records no MoE routing"

    @abstractmethod
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSpec,
                 adapter: RunAdapter | None = None) -> list[list[GeneratedSample]]:
        """`n` samples for each prompt, in prompt order (version_runs left empty), with `adapter` as
        `RolloutEngine.generate`; InvalidRequest if the engine refuses the request."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in place with HF-named full tensors (already validated)."""

    @abstractmethod
    def load_weights_from_path(self, path: Path) -> None:
        """Replace weights in place from a folder of HF-named *.safetensors (already validated)."""

    def load_adapter(self, folder: Path, base: Path) -> None:
        """Generate with the PEFT adapter in `folder` on the base model in `base` from now on (already
        validated; the engine loads the base first when it serves other weights)."""
        raise NotImplementedError(f"the {self.name} engine serves without LoRA (enable_lora in its args)")

    def drop_adapter(self, adapter_id: int) -> None:
        """As `RolloutEngine.drop_adapter`."""

    def use_deployed_base(self) -> None:
        """As `RolloutEngine.use_deployed_base`."""
        raise NotImplementedError(f"the {self.name} engine cannot restore the deployed model")

    def weight_digests(self) -> dict[str, str]:
        """As `RolloutEngine.weight_digests`, without the version."""
        raise NotImplementedError(f"the {self.name} engine cannot digest its weights")

    @abstractmethod
    def info(self) -> EngineInfo: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...
