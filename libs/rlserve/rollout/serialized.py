"""A synchronous `BatchEngine` served as a `RolloutEngine`: one call at a time, off the event loop.

Generation and weight loads take turns under one lock, so every sample comes
from exactly one weight version whatever the caller asks (`in_flight` cannot
apply to a batch that holds the engine until it is done). A cancelled caller
keeps the lock until its thread is done (`in_thread_to_the_end`): the engine
is not re-entrant. This is the
transformers engine's simple path; vLLM's engine serves concurrently instead.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from rlserve.rollout.activity import Activity
from rlserve.rollout.interfaces import (
    BatchEngine,
    EngineInfo,
    EngineStats,
    GeneratedSample,
    RolloutEngine,
    SamplingSpec,
    VersionRun,
)
from rlserve.threads import in_thread_to_the_end


class Serialized(RolloutEngine):
    def __init__(self, engine: BatchEngine):
        self.engine = engine
        self.name = engine.name
        self._lock = asyncio.Lock()
        self._version = 0
        self._activity = Activity()

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSpec) -> list[list[GeneratedSample]]:
        async with self._lock:
            version = self._version
            self._activity.request_started()
            try:
                out = await in_thread_to_the_end(self.engine.generate, prompts, n, sampling)
            finally:
                self._activity.request_finished()
        return [[replace(s, version_runs=(VersionRun(version, 0, len(s.token_ids)),)) for s in group]
                for group in out]

    async def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int, in_flight: bool) -> None:
        async with self._lock:
            await in_thread_to_the_end(self.engine.load_weights, named_tensors)
            self._version = version

    async def load_weights_from_path(self, path: Path, version: int, in_flight: bool) -> None:
        async with self._lock:
            await in_thread_to_the_end(self.engine.load_weights_from_path, path)
            self._version = version

    async def load_adapter(self, folder: Path, base: Path, version: int, in_flight: bool) -> None:
        async with self._lock:
            try:
                await in_thread_to_the_end(self.engine.load_adapter, folder, base)
            finally:
                shutil.rmtree(folder, ignore_errors=True)  # read whole: the engine keeps its tensors
            self._version = version

    def stats(self) -> EngineStats:
        return self._activity.stats()

    def info(self) -> EngineInfo:
        return self.engine.info()

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)
