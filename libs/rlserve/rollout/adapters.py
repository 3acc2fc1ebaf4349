"""Runs' LoRA adapters on the deployed base, served at once: one replica's table of them.

A LoRA run on the deployed model (`RunSpec.shares_deployed_base`) does not take
the rollout over. The learner publishes its adapter under the run's id
(`WeightStore.publish_adapter`), and a replica loads it when a request of that
run arrives and the store holds a newer version than the replica (or the
replica holds none). Every loaded version gets a new adapter id, so loading
run A's version n+1 never pauses run B's requests, nor A's own requests still
running on version n: the old id is dropped from the engine once its last
request ends. An engine that evicted an adapter (vLLM keeps `max_loras` of
them on the device) reads it again from its folder, which stays until the
version is dropped.

A replica keeps at most `max_held` runs' adapters; the least recently used
idle one goes first (it is loaded again from the store on its run's next
request).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray

from rlserve.logs import event
from rlserve.rollout.interfaces import RolloutEngine, RunAdapter
from rlserve.rpc import aborted, invalid_argument
from rlserve.weights import adapter
from rlserve.weights.specs import TensorSpec
from rlserve.weights.store import fetch_tensors

log = logging.getLogger("rlserve.rollout")
_SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
# The exclusive adapter slot of a run on its own base uses id 1 (`vllm_engine`); runs' adapters come after.
_FIRST_ID = 2


@dataclass
class _Held:
    """A run's adapter versions on this replica: the newest, and older ones still generating."""

    current: RunAdapter
    publish_id: int
    in_use: dict[int, int] = field(default_factory=dict)  # adapter id -> requests running on it
    retired: dict[int, RunAdapter] = field(default_factory=dict)  # older versions, dropped when idle
    last_used: float = 0.0


class RunAdapters:
    def __init__(self, store: ray.actor.ActorHandle, engine: RolloutEngine,
                 check: Callable[[dict[str, TensorSpec], dict], list[str]], replica_id: str, max_held: int):
        """`check(tensor specs, adapter config)`: the problems of an adapter for the deployed base."""
        self.store, self.engine, self.check = store, engine, check
        self.replica_id, self.max_held = replica_id, max_held
        self._held: dict[str, _Held] = {}
        self._loading: dict[str, asyncio.Lock] = {}  # one load per run at a time
        self._ids = itertools.count(_FIRST_ID)

    def versions(self) -> dict[str, int]:
        """Run id -> the newest adapter version this replica holds."""
        return {run_id: h.current.version for run_id, h in self._held.items()}

    async def acquire(self, run_id: str, min_version: int) -> RunAdapter:
        """The run's newest adapter (loaded from the store when the store has a newer one); ABORTED when no
        version >= `min_version` is published. Pair with `release`."""
        head = await self.store.adapter_head.remote(run_id)
        held = self._held.get(run_id)
        if head is not None and (held is None or head[0] > held.publish_id):
            held = await self._load(run_id)
        if held is None or held.current.version < min_version:
            have = "none" if held is None else f"version {held.current.version}"
            raise aborted(f"run {run_id!r}: no adapter of version >= {min_version} is published (the weight store "
                          f"holds {have})")
        ref = held.current
        held.in_use[ref.adapter_id] = held.in_use.get(ref.adapter_id, 0) + 1
        held.last_used = time.monotonic()
        return ref

    async def acquire_folder(self, folder: Path) -> RunAdapter:
        """The PEFT adapter saved in `folder` (a Tinker sampler's weights), held like a run's adapter (the same
        eviction) under the key `folder:PATH@MTIME`, so a folder saved again is a new adapter. Pair with
        `release`."""
        try:
            stamp = (folder / adapter.WEIGHTS_FILE).stat().st_mtime_ns
        except OSError:
            raise invalid_argument("adapter_path", f"{folder} holds no PEFT adapter") from None
        key = f"folder:{folder}@{stamp}"
        async with self._loading.setdefault(key, asyncio.Lock()):
            held = self._held.get(key)
            if held is not None:
                ref = held.current
                held.in_use[ref.adapter_id] = held.in_use.get(ref.adapter_id, 0) + 1
                held.last_used = time.monotonic()
                return ref
            t0 = time.perf_counter()
            tensors, config = await asyncio.to_thread(adapter.read_adapter, folder)
            problems = self.check({n: TensorSpec(tuple(t.shape), t.dtype) for n, t in tensors.items()}, config)
            if problems:
                raise invalid_argument("adapter_path", f"{folder}: " + "; ".join(problems[:5]))
            # A copy of its own: the saved folder may be deleted while an engine still reads it.
            copy = Path(tempfile.mkdtemp(prefix="rlserve-run-adapter-", dir=_SHM))
            await asyncio.to_thread(adapter.write_adapter, copy, tensors, config)
            ref = RunAdapter(next(self._ids), key, 0, copy)
            # In use before the eviction it may cause, which then takes another adapter.
            self._held[key] = _Held(ref, 0, {ref.adapter_id: 1}, last_used=time.monotonic())
            await self._evict()
            event(log, "rollout.adapter_loaded", replica=self.replica_id, folder=str(folder),
                  adapter_id=ref.adapter_id, seconds=time.perf_counter() - t0)
            return ref

    async def release(self, ref: RunAdapter) -> None:
        held = self._held.get(ref.run_id)
        if held is None:
            return
        left = held.in_use[ref.adapter_id] = held.in_use.get(ref.adapter_id, 1) - 1
        if left <= 0 and ref.adapter_id in held.retired:
            await self._drop(held.retired.pop(ref.adapter_id))
            held.in_use.pop(ref.adapter_id, None)

    async def _load(self, run_id: str) -> _Held | None:
        """Fetch, check and write the run's newest adapter (its old version retires); one load per run at a time."""
        async with self._loading.setdefault(run_id, asyncio.Lock()):
            held = self._held.get(run_id)
            pub = await self.store.adapter.remote(run_id)
            if pub is None or (held is not None and pub.publish_id <= held.publish_id):
                return held
            if pub.adapter_config is None:
                raise invalid_argument("shared_base", f"run {run_id!r} published full weights, not an adapter")
            t0 = time.perf_counter()
            tensors = await fetch_tensors(pub)
            problems = self.check({n: TensorSpec(tuple(t.shape), t.dtype) for n, t in tensors.items()},
                                  pub.adapter_config)
            if problems:
                raise invalid_argument("weights", f"run {run_id!r}: " + "; ".join(problems[:5]))
            folder = Path(tempfile.mkdtemp(prefix="rlserve-run-adapter-", dir=_SHM))
            await asyncio.to_thread(adapter.write_adapter, folder, tensors, pub.adapter_config)
            ref = RunAdapter(next(self._ids), run_id, pub.version, folder)
            if held is None:
                # Newest used: the eviction it may cause takes another run's adapter, not the one just loaded.
                held = self._held[run_id] = _Held(ref, pub.publish_id, last_used=time.monotonic())
                await self._evict()
            else:
                old, held.current, held.publish_id = held.current, ref, pub.publish_id
                if held.in_use.get(old.adapter_id, 0) > 0:
                    held.retired[old.adapter_id] = old
                else:
                    held.in_use.pop(old.adapter_id, None)
                    await self._drop(old)
            event(log, "rollout.adapter_loaded", replica=self.replica_id, run=run_id, version=pub.version,
                  adapter_id=ref.adapter_id, seconds=time.perf_counter() - t0)
            return held

    async def _evict(self) -> None:
        """Beyond `max_held` runs: forget the least recently used run whose adapters are idle."""
        while len(self._held) > self.max_held:
            idle = [(h.last_used, run_id) for run_id, h in self._held.items() if not any(h.in_use.values())]
            if not idle:
                return
            run_id = min(idle)[1]
            held = self._held.pop(run_id)
            self._loading.pop(run_id, None)
            for ref in [held.current, *held.retired.values()]:
                await self._drop(ref)
            event(log, "rollout.adapter_evicted", replica=self.replica_id, run=run_id, version=held.current.version)

    async def _drop(self, ref: RunAdapter) -> None:
        try:
            await self.engine.drop_adapter(ref.adapter_id)
        finally:
            shutil.rmtree(ref.folder, ignore_errors=True)

    async def close(self) -> None:
        for held in self._held.values():
            for ref in [held.current, *held.retired.values()]:
                shutil.rmtree(ref.folder, ignore_errors=True)
        self._held.clear()
