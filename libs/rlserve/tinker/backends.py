"""What the Tinker API trains and samples on, as two small protocols, and their implementations over
rlserve's own parts: `TableTrainer` over the learner's session table (`rlserve.learner.sessions`: one
session per model, LoRA runs of any rank sharing one frozen base per worker layout and taking fair turns),
and `EngineSampler` over a rollout engine (`rlserve.rollout`): adapters served side by side by id, loaded
from their folders on first use and again after the engine dropped them (`max_adapters` held at once,
least recently used dropped first), never answered with an error.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from rlserve.config import RunSpec
from rlserve.learner.interfaces import StepResult
from rlserve.learner.sessions import SessionTable
from rlserve.rollout.interfaces import BatchEngine, GeneratedSample, RunAdapter, SamplingSpec
from rlserve.training.primitives import AdamStep, DatumBatch, PrimitiveResult


class Trainer(Protocol):
    async def configure(self, run_id: str, spec: RunSpec, base: Path, init_adapter: Path | None) -> None: ...

    async def forward(self, run_id: str, batch: DatumBatch, backward: bool) -> PrimitiveResult: ...

    async def optim_step(self, run_id: str, step: AdamStep) -> StepResult: ...

    async def save(self, run_id: str, path: Path, adapter_path: Path | None) -> None: ...

    async def load(self, run_id: str, path: Path) -> int: ...

    async def release(self, run_id: str) -> None: ...


class Sampler(Protocol):
    async def sample(self, adapter: Path | None, prompt: list[int], n: int, sampling: SamplingSpec
                     ) -> list[GeneratedSample]: ...

    async def prompt_logprobs(self, adapter: Path | None, prompt: list[int], topk: int
                              ) -> tuple[list[float], list[list[tuple[int, float]]]]: ...


class TableTrainer:
    """The learner's session table (in the learner's replica, or in process over `InProcessWorkerGroup`)."""

    def __init__(self, table: SessionTable):
        self.table = table

    async def configure(self, run_id: str, spec: RunSpec, base: Path, init_adapter: Path | None) -> None:
        await self.table.configure(run_id, spec, base, init_adapter, shared_base=True)

    async def forward(self, run_id: str, batch: DatumBatch, backward: bool) -> PrimitiveResult:
        return await self.table.forward_primitive(run_id, batch, backward)

    async def optim_step(self, run_id: str, step: AdamStep) -> StepResult:
        return await self.table.optim_step(run_id, step)

    async def save(self, run_id: str, path: Path, adapter_path: Path | None) -> None:
        await self.table.save_checkpoint(run_id, path, adapter_path)

    async def load(self, run_id: str, path: Path) -> int:
        return await self.table.load_checkpoint(run_id, path)

    async def release(self, run_id: str) -> None:
        await self.table.release(run_id)


class EngineSampler:
    """A synchronous engine (the transformers engine), one call at a time in a worker thread."""

    def __init__(self, engine: BatchEngine, max_adapters: int = 4):
        self.engine, self.max_adapters = engine, max_adapters
        self._ids = itertools.count(1)
        self._held: OrderedDict[Path, int] = OrderedDict()  # folder -> adapter id, least recently used first
        self._lock = asyncio.Lock()
        self.reloads = 0  # adapters loaded again after they were dropped (for tests and metrics)
        self._dropped: set[Path] = set()

    def _adapter(self, folder: Path | None) -> RunAdapter | None:
        if folder is None:
            return None
        if folder in self._held:
            self._held.move_to_end(folder)
        else:
            if len(self._held) >= self.max_adapters:
                old, old_id = self._held.popitem(last=False)
                self.engine.drop_adapter(old_id)
                self._dropped.add(old)
            if folder in self._dropped:
                self.reloads += 1
                self._dropped.discard(folder)
            self._held[folder] = next(self._ids)
        return RunAdapter(self._held[folder], folder.parent.name, 0, folder)

    def evict(self, folder: Path) -> None:
        """Drop `folder`'s adapter from the engine now (its next use loads it again)."""
        adapter_id = self._held.pop(folder, None)
        if adapter_id is not None:
            self.engine.drop_adapter(adapter_id)
            self._dropped.add(folder)

    async def sample(self, adapter: Path | None, prompt: list[int], n: int, sampling: SamplingSpec
                     ) -> list[GeneratedSample]:
        async with self._lock:
            run_adapter = self._adapter(adapter)
            out = await asyncio.to_thread(self.engine.generate, [prompt], n, sampling, run_adapter)
        return out[0]

    async def prompt_logprobs(self, adapter: Path | None, prompt: list[int], topk: int
                              ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        score = getattr(self.engine, "prompt_logprobs", None)
        if score is None:
            raise NotImplementedError(f"the {self.engine.name} engine does not score prompts")
        async with self._lock:
            run_adapter = self._adapter(adapter)
            return await asyncio.to_thread(score, prompt, topk, run_adapter)
