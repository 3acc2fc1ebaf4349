"""A synchronous `BatchEngine` served as a `RolloutEngine`: one call at a time, off the event loop.

Generation and weight loads take turns under one lock, so every sample comes
from exactly one weight version whatever the caller asks (`in_flight` cannot
apply to a batch that holds the engine until it is done). A cancelled caller
keeps the lock until its thread is done (`in_thread_to_the_end`): the engine
is not re-entrant. Runs' adapters
(`RunAdapter`) take turns like everything else: one batch of one adapter at a
time. This is the transformers engine's simple path; vLLM's engine serves concurrently instead.
A same-device handoff from the learner (`rlserve.weights.handoff`) stages its
bytes while the engine generates and loads them under the lock.
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
    RunAdapter,
    SamplingSpec,
    VersionRun,
)
from rlserve.threads import in_thread_to_the_end
from rlserve.weights.handoff import HandoffReceiver


class Serialized(RolloutEngine):
    def __init__(self, engine: BatchEngine):
        self.engine = engine
        self.name = engine.name
        self._lock = asyncio.Lock()
        self._version = 0
        self._activity = Activity()
        # A same-device handoff stages the bytes while the engine generates; the model changes at finish.
        self.transfer_backend = engine.transfer_backend
        self.routing_unavailable = engine.routing_unavailable
        self._receiver = HandoffReceiver(engine.device) if engine.transfer_backend else None

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSpec,
                       adapter: RunAdapter | None = None) -> list[list[GeneratedSample]]:
        async with self._lock:
            version = self._version if adapter is None else adapter.version
            self._activity.request_started()
            out = []
            try:
                out = await in_thread_to_the_end(self.engine.generate, prompts, n, sampling, adapter)
            finally:
                self._activity.request_finished(sum(len(s.token_ids) for group in out for s in group))
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

    async def drop_adapter(self, adapter_id: int) -> None:
        async with self._lock:
            await in_thread_to_the_end(self.engine.drop_adapter, adapter_id)

    async def use_deployed_base(self) -> None:
        async with self._lock:
            await in_thread_to_the_end(self.engine.use_deployed_base)
            self._version = 0

    def _handoff(self) -> HandoffReceiver:
        if self._receiver is None:
            raise NotImplementedError(f"the {self.name} engine takes weights from the weight store only "
                                      f"(weight_transfer: ipc hands them over on its device)")
        return self._receiver

    async def init_weight_transfer(self, init_info: dict) -> None:
        self._handoff().init(init_info)

    async def start_weight_update(self, in_flight: bool) -> None:
        self._handoff().start()

    async def update_weights(self, update_info: dict) -> None:
        await asyncio.to_thread(self._handoff().receive, update_info)

    async def finish_weight_update(self, version: int, in_flight: bool) -> None:
        staged = self._handoff().take()
        async with self._lock:
            await in_thread_to_the_end(self.engine.load_weights, staged.items())
            self._version = version

    async def abort_weight_update(self) -> None:
        self._handoff().abort()

    async def weight_digests(self) -> tuple[int, dict[str, str]]:
        async with self._lock:
            return self._version, await in_thread_to_the_end(self.engine.weight_digests)

    def stats(self) -> EngineStats:
        return self._activity.stats()

    def info(self) -> EngineInfo:
        return self.engine.info()

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)
