"""The rollout engine contract: what the rollout service needs from vLLM or transformers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class InvalidRequest(ValueError):
    """The engine's own validation refused a request (vLLM's sampling checks, say): the caller's
    mistake, answered INVALID_ARGUMENT and never retried."""


class EngineSettings(BaseModel):
    """How an engine is started (the rollout app's deploy arguments hold these; defaults live here)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
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


class EngineConfig(EngineSettings):
    model_path: Path


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 16
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class GeneratedSample:
    token_ids: list[int]
    # Logprob of each sampled token under the model's own (temperature-1) distribution.
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""


@dataclass
class EngineInfo:
    engine: str
    model: str
    max_model_len: int
    vocab_size: int
    dtype: str
    extra: dict[str, str] = field(default_factory=dict)


class RolloutEngine(ABC):
    """One generation engine. Not thread-safe: the service serialises calls."""

    name: str

    @abstractmethod
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSpec) -> list[list[GeneratedSample]]:
        """`n` samples for each prompt, in prompt order; InvalidRequest if the engine refuses the request."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in place with HF-named full tensors (already validated)."""

    @abstractmethod
    def load_weights_from_path(self, path: Path) -> None:
        """Replace weights in place from a folder of HF-named *.safetensors (already validated)."""

    @abstractmethod
    def info(self) -> EngineInfo: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...
