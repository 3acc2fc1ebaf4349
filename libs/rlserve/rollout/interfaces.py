"""The rollout engine contract: what the rollout service needs from vLLM or transformers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class EngineConfig:
    """How an engine is started; comes from the rollout app's deploy arguments."""

    model_path: Path
    dtype: str = "float32"
    max_model_len: int = 256
    seed: int = 0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    kv_cache_gb: float = 1.0
    # vLLM: "auto" reloads weights in place where that is known to be correct and rebuilds the
    # engine otherwise; "rebuild" always starts a new engine on the new weights (slow, for checks).
    weight_reload: str = "auto"


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
        """`n` samples for each prompt, in prompt order."""

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
