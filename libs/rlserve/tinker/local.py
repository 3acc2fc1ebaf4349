"""The Tinker API's parts in one process, without a cluster (tests, benchmarks): the learner's session table
(`TableTrainer`), a synchronous rollout engine (`EngineSampler`) and models' runs in memory (`LocalRuns`).
`rlserve.tinker.backends` has the protocols and the cluster's implementations.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlserve.config import RunSpec
from rlserve.learner.interfaces import StepResult
from rlserve.learner.sessions import SessionTable
from rlserve.rollout.interfaces import BatchEngine, RunAdapter, SamplingSpec
from rlserve.security.principal import Principal
from rlserve.tinker.backends import Sampled, WaitReason
from rlserve.training.primitives import AdamStep, DatumBatch, PrimitiveResult


class TableTrainer:
    """The learner's session table (in process over `InProcessWorkerGroup`)."""

    def __init__(self, table: SessionTable):
        self.table = table

    async def configure(self, run_id: str, spec: RunSpec, base: Path, init_adapter: Path | None) -> int:
        return (await self.table.configure(run_id, spec, base, init_adapter, shared_base=True)).world_size

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

    async def sample(self, run_id: str, priority: float, adapter: Path | None, prompt: list[int], n: int,
                     sampling: SamplingSpec) -> Sampled:
        async with self._lock:
            t0 = time.perf_counter()
            run_adapter = self._adapter(adapter)
            out = (await asyncio.to_thread(self.engine.generate, [prompt], n, sampling, run_adapter))[0]
            seconds = time.perf_counter() - t0
        first = out[0]
        return Sampled(out, None if first.prompt_logprobs is None else list(first.prompt_logprobs),
                       None if first.prompt_top_logprobs is None else [list(r) for r in first.prompt_top_logprobs],
                       seconds)


@dataclass
class LocalRuns:
    """Models' runs in memory: each user holds at most `max_models` (more wait, "for the user's quota"), and
    what they spend is summed per run (`usage`)."""

    max_models: int = 4
    usage: dict[str, dict[str, float]] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    _open: dict[str, str] = field(default_factory=dict)  # run id -> owner
    _tasks: set[asyncio.Task] = field(default_factory=set)

    async def open(self, caller: Principal, run_id: str, spec: RunSpec, body: Callable[[], Awaitable[None]],
                   waiting: Callable[[WaitReason, str], None]) -> None:
        while sum(owner == caller.name for owner in self._open.values()) >= self.max_models:
            waiting("quota", f"{caller.name} holds {self.max_models} models, the most a user may at once "
                             f"(unload one, or end its session)")
            await asyncio.sleep(0.1)
        self._open[run_id] = caller.name
        started = asyncio.Event()

        async def run() -> None:
            started.set()
            try:
                await body()
            finally:
                self._open.pop(run_id, None)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await started.wait()

    def meter(self, run_id: str, usage: dict[str, float], version: int | None) -> None:
        mine = self.usage.setdefault(run_id, {})
        for key, value in usage.items():
            mine[key] = mine.get(key, 0.0) + value
        if version is not None:
            self.steps[run_id] = self.steps.get(run_id, 0) + 1
