"""The learner backend contract, shared by the DTensor/FSDP2 and Megatron-Core backends.

A backend is plain torch.distributed code: every rank of a process group
constructs it and calls the same methods in the same order. It never
imports Ray, so it runs the same under the learner's Ray workers and under
`torchrun` (the GPU benchmarks).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from rlserve.training.batch import TrainBatch

LossName = Literal["grpo", "sft"]


@dataclass(frozen=True)
class BackendInfo:
    backend: str
    world_size: int
    parallel_layout: str
    num_parameters: int
    device: str


@dataclass(frozen=True)
class StepResult:
    version: int
    metrics: dict[str, float]


class LearnerBackend(ABC):
    name: str

    @abstractmethod
    def info(self) -> BackendInfo: ...

    @property
    @abstractmethod
    def version(self) -> int:
        """Number of GRPO/SFT steps applied since the initial weights (version 0)."""

    @abstractmethod
    def train_step(self, batch: TrainBatch, loss: LossName, lr: float | None = None) -> StepResult:
        """One step on the whole batch (every rank passes the same batch; each takes its share)."""

    @abstractmethod
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF checkpoint-named full tensors, one at a time. Every rank must exhaust the iterator
        (gathers are collective); only rank 0 gets the tensors, other ranks get empty placeholders."""

    @abstractmethod
    def save_checkpoint(self, path: Path) -> None:
        """Model, optimizer, scheduler, RNG and version (torch distributed checkpoint)."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> int:
        """Restore what save_checkpoint wrote; returns the version."""

    @abstractmethod
    def save_hf(self, path: Path) -> None:
        """Write the policy as an HF folder (config, tokenizer, safetensors) from rank 0."""
