"""The learner's side of weight sync: send each version straight to every engine, keep one store copy.

`Publisher.publish` walks the backend's export once (every learner rank
walks it: the gathers are collective; rank 0 gets the tensors). On rank 0
each tensor goes

- to every rollout engine through vLLM's weight-transfer API
  (`WeightTransferTrainerFactory.trainer_init` with the engine the replicas
  run: `gloo`, `nccl` or `ipc`; `FleetClient` reaches the replicas through the
  fleet, `rlserve.weights.fleet`), or, for engines on the learner's own GPU
  without vLLM, by rlserve's same-device handoff (`rlserve.weights.handoff`: CUDA IPC or shared memory), and
- into the object store, bucket by bucket (`rlserve.weights.buckets`): the one
  copy that replicas starting later catch up from, published in the weight
  store (`rlserve.weights.store`) and then announced to the fleet, so that a
  replica the direct transfer missed loads it at once.

Rank 0 holds at most a bucket of tensors for each of the two at a time, never
the model, except after a same-device handoff that reached every engine: then the
store copy is a host-memory snapshot of the model, put into the object store
by a background thread after the round (off the step's path: it took 2.8 s of a
3.9 s weight sync for the 1b preset on an H200), before the next version's
round starts. The first version of a session goes through the store only: the
transfer needs the tensors' names, dtypes and shapes up front, and the export
order is learned from that first walk without any extra gather.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray
import torch

from rlserve.learner.interfaces import LearnerBackend
from rlserve.learner.publishing import Published, Publishing
from rlserve.logs import event
from rlserve.weights import handoff as same_device
from rlserve.weights.buckets import BucketWriter, to_host
from rlserve.weights.fleet import Member, get_fleet
from rlserve.weights.store import get_store

log = logging.getLogger("rlserve.learner")


class FleetClient:
    """vLLM's `VLLMWeightSyncClient` over the fleet: every call reaches every member.

    Members that fail a step (or stop answering) are dropped from the rest of
    the round instead of failing it; they catch up from the store copy.
    """

    def __init__(self, fleet: ray.actor.ActorHandle, members: list[Member], timeout_s: float):
        self.fleet, self.members, self.timeout_s = fleet, members, timeout_s
        self.first_rank: dict[str, int] = {}
        rank = 0
        for m in members:
            self.first_rank[m.member_id] = rank
            rank += m.num_workers
        self.failed: dict[str, str] = {}
        self.round: dict[str, Any] = {}
        self._start: dict[str, Any] | None = None  # a round's start, sent with its first step

    def begin(self, run_id: str, version: int, in_flight: bool) -> None:
        self.round = {"run_id": run_id, "version": version, "in_flight": in_flight}

    def live_ranks(self) -> list[int]:
        """Group ranks (after the sender's 0) of the members still in the round."""
        return [1 + self.first_rank[m.member_id] + w for m in self.members if m.member_id not in self.failed
                for w in range(m.num_workers)]

    def _fan_out(self, kind: str, payload: dict[str, dict]) -> None:
        live = {mid: p for mid, p in payload.items() if mid not in self.failed}
        if not live:
            return
        if self._start is not None:
            live = {mid: {**p, "start": self._start} for mid, p in live.items()}
            self._start = None
        results = ray.get(self.fleet.command.remote(kind, live, self.timeout_s))
        for member_id, error in results.items():
            if error is not None:
                self.failed[member_id] = f"{kind}: {error}"
                event(log, "learner.weight_transfer_member_failed", logging.WARNING, member=member_id,
                      step=kind, error=error[:300])
        if all(mid in self.failed for mid in live):
            raise RuntimeError(f"every rollout replica failed the weight-transfer step {kind!r}: "
                               f"{sorted(set(self.failed.values()))[:3]}")

    def _each(self, payload: dict) -> dict[str, dict]:
        return {m.member_id: payload for m in self.members}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._fan_out("init", {m.member_id: {"init_info": {
            **init_info, "rank_offset": init_info.get("rank_offset", 1) + self.first_rank[m.member_id]}}
            for m in self.members})

    def start_weight_update(self) -> None:
        """Travels with the round's first update: each member starts, then takes it (a round trip fewer)."""
        self._start = {"in_flight": self.round["in_flight"], "run_id": self.round["run_id"]}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._fan_out("update", self._each({"update_info": update_info}))

    def live_members(self) -> list[str]:
        return [m.member_id for m in self.members if m.member_id not in self.failed]

    def update_weights_each(self, update_infos: dict[str, dict[str, Any]], last: bool = False) -> None:
        """`update_weights` with each member's own info (a CUDA IPC handle is one consumer's). `last`: the
        round's finish travels with this update (a round trip fewer); do not call `finish_weight_update`."""
        extra = {"finish": self.round} if last else {}
        self._fan_out("update", {member_id: {"update_info": info, **extra} for member_id, info in update_infos.items()})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        del weight_version  # the round's version is stamped by each engine
        self._fan_out("finish", self._each(self.round))

    def abort(self) -> None:
        self._start = None
        self._fan_out("abort", self._each({}))


class ExportSource:
    """vLLM's `WeightSource` over a learner backend's export, copying each tensor to the store.

    Each round (`begin`) is one walk of the export. `metadata()` is what the
    previous walk yielded: the export order is fixed for a session.
    """

    def __init__(self, backend: LearnerBackend):
        self.backend = backend
        self.known: list | None = None
        self._dtype: torch.dtype | None = None
        self._copy: BucketWriter | None = None
        self._walk: Iterator[tuple[str, torch.Tensor]] | None = None
        self._seen: list = []
        self._complete = False
        self._on_device = False
        self.store_seconds = 0.0

    def begin(self, dtype: torch.dtype | None, copy: BucketWriter, on_device: bool = False) -> None:
        """`on_device`: the walk yields device tensors (a same-device handoff); the store copy is moved to the
        host here."""
        self._dtype, self._copy, self._seen, self._complete = dtype, copy, [], False
        self._on_device, self.store_seconds = on_device, 0.0
        self._walk = self._tensors()

    def metadata(self) -> list:
        if self.known is None:
            raise RuntimeError("the export order is not known yet (the first version goes through the store)")
        return self.known

    def held_names(self) -> None:
        return None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._walk

    def finish(self) -> None:
        """Walk the rest of this round (the gathers are collective: every rank must walk all of it)."""
        for _ in self._walk:
            pass
        if not self._complete:
            raise RuntimeError("the weight export stopped before its end")
        self.known = self._seen

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            from vllm.distributed.weight_transfer.base import ParamMeta
        except ImportError:  # no vLLM here (a GPU node with the transformers engine): no direct transfer
            # either, so the export order is only recorded, as vLLM's (name, dtype, shape) would be.
            ParamMeta = _ParamMeta  # noqa: N806

        for name, tensor in self.backend.export_weights(self._dtype, self._on_device):
            self._seen.append(ParamMeta(name, tensor.dtype, tuple(tensor.shape)))
            t0 = time.perf_counter()
            self._copy.add(name, to_host(tensor) if self._on_device else tensor)
            self.store_seconds += time.perf_counter() - t0
            yield name, tensor
        t0 = time.perf_counter()
        self._copy.flush()
        self.store_seconds += time.perf_counter() - t0
        self._complete = True


@dataclass(frozen=True)
class _ParamMeta:
    """vLLM's `ParamMeta` (name, wire dtype, full shape) where vLLM is not installed."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class Publisher:
    """Rank 0's weight sync for one learner session (keeps the transfer group between versions)."""

    def __init__(self, backend: LearnerBackend, store: ray.actor.ActorHandle, fleet: ray.actor.ActorHandle,
                 bucket_bytes: int, timeout_s: float):
        self.backend, self.store, self.fleet = backend, store, fleet
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.source = ExportSource(backend)
        self._engine = None
        self._client: FleetClient | None = None
        self._group_key: tuple | None = None
        self._generation = 0
        # A same-device handoff's store copy, put after the round (one at a time, in version order).
        self._store_copy: Future | None = None
        self._store_copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlserve-store-copy")

    def publish(self, run_id: str, dtype: torch.dtype | None, in_flight: bool, direct: bool,
                shared_base: bool = False) -> Published:
        """Send this version to the engines (`direct`, from the session's second version on), publish
        the store copy and announce it to the fleet. With `shared_base` (a LoRA run on the deployed
        base) the adapter is published under the run's id only: replicas load it on the run's next
        request there, and nothing else they serve changes."""
        if shared_base and self.backend.adapter_config is None:
            raise ValueError("shared_base: the run trains without LoRA; only an adapter is served beside others")
        self._wait_for_store_copy()  # the previous version's: publications stay in order
        t0 = time.perf_counter()
        version = self.backend.version
        direct_bytes, receivers, failed, direct_seconds = 0, 0, {}, 0.0
        # An adapter goes through the store only: vLLM loads adapters from a folder (its weight-transfer
        # API reloads base parameters), and an adapter is small.
        members = (self._receivers() if direct and self.source.known is not None
                   and self.backend.adapter_config is None and not shared_base else [])
        # A same-device handoff keeps the store copy's buckets in host memory (a snapshot: training may change
        # the weights next) and puts them into the object store after the round, off the step's path.
        handoff = bool(members) and members[0].transfer_backend == same_device.BACKEND
        refs: list[ray.ObjectRef] = []
        held: list[dict[str, torch.Tensor]] = []
        copy = BucketWriter(self.bucket_bytes, held.append if handoff else lambda bucket: refs.append(ray.put(bucket)))
        self.source.begin(dtype, copy, on_device=handoff)
        if members:
            try:
                engine = self._ensure_group(members)
                self._client.begin(run_id, version, in_flight)
                engine.send_weights()
                direct_bytes, receivers = engine.bytes_sent, len(members)
                failed = dict(self._client.failed)
                failed.update({f"rank {r}": "link lost" for r in getattr(engine, "failed_ranks", ())})
            except Exception as err:  # noqa: BLE001 - the store copy below still reaches every replica
                failed = {"all": f"{type(err).__name__}: {err}"}
                event(log, "learner.weight_transfer_failed", logging.WARNING, version=version,
                      error=str(err)[:300])
                if self._client is not None:
                    self._client.abort()
            if failed:
                self._group_key = None  # re-form the group next time
            direct_seconds = time.perf_counter() - t0 - self.source.store_seconds
        self.source.finish()
        store_copy = partial(self._put_and_announce, run_id, version, refs, held, copy.num_tensors, copy.num_bytes,
                             in_flight, shared_base)
        if handoff and not failed:  # every engine has it: the copy is for replicas that start later
            self._put_in_background(store_copy, run_id, version)
        else:
            store_copy()
        model_bytes = self.backend.info().num_parameters * (dtype or torch.float32).itemsize
        seconds = time.perf_counter() - t0
        return Published(version, copy.num_buckets, copy.num_tensors, copy.num_bytes, model_bytes, seconds,
                         direct_seconds, seconds - direct_seconds, direct_bytes, receivers, failed)

    def _put_and_announce(self, run_id: str, version: int, refs: list[ray.ObjectRef],
                          held: list[dict[str, torch.Tensor]], num_tensors: int, num_bytes: int, in_flight: bool,
                          shared_base: bool) -> None:
        t0 = time.perf_counter()
        refs = refs + [ray.put(bucket) for bucket in held]
        if shared_base:
            ray.get(self.store.publish_adapter.remote(run_id, version, refs, num_tensors, num_bytes,
                                                      self.backend.adapter_config))
            return
        publish_id = ray.get(self.store.publish.remote(run_id, version, refs, num_tensors, num_bytes, in_flight,
                                                       adapter_config=self.backend.adapter_config))
        ray.get(self.fleet.announce.remote(publish_id, version))
        if held:
            event(log, "learner.store_copy_published", run=run_id, version=version, mib=num_bytes / 2**20,
                  seconds=time.perf_counter() - t0)

    def _wait_for_store_copy(self) -> None:
        """A background put that failed fails the next publication (its replicas could not catch up); the
        operator sees it when it happens."""
        if self._store_copy is not None:
            copy, self._store_copy = self._store_copy, None
            copy.result()

    def _put_in_background(self, store_copy: partial, run_id: str, version: int) -> None:
        def put() -> None:
            try:
                store_copy()
            except Exception as err:
                event(log, "learner.store_copy_failed", logging.ERROR, run=run_id, version=version,
                      error=f"{type(err).__name__}: {err}"[:300])
                raise

        self._store_copy = self._store_copier.submit(put)

    def _receivers(self) -> list[Member]:
        generation, members = ray.get(self.fleet.members.remote())
        direct = [m for m in members if m.transfer_backend]
        backends = {m.transfer_backend for m in direct}
        if len(backends) > 1:
            event(log, "learner.weight_transfer_mixed_engines", logging.WARNING, engines=sorted(backends))
            return []
        self._generation = generation
        return direct

    def _ensure_group(self, members: list[Member]):
        """The trainer-side transfer engine for these members, formed anew when they changed."""
        key = (self._generation, tuple(m.member_id for m in members))
        if key == self._group_key:
            self._client.failed.clear()
            return self._engine
        if self._engine is not None:
            self._engine.shutdown()
        self._client = FleetClient(self.fleet, members, self.timeout_s)
        backend = members[0].transfer_backend
        world_size = 1 + sum(m.num_workers for m in members)
        if backend == same_device.BACKEND:  # rlserve's own handoff: nodes that use it have no vLLM
            self._engine = same_device.HandoffSender.trainer_init(self._client, self.source, self.bucket_bytes,
                                                                  self.backend.device)
        else:
            from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

            from rlserve.weights import gloo_transfer

            gloo_transfer.register_sender()
            info = trainer_init_info(backend, world_size, self.bucket_bytes, self.timeout_s)
            self._engine = WeightTransferTrainerFactory.trainer_init(info, client=self._client, source=self.source)
        self._group_key = key
        event(log, "learner.weight_transfer_group", engine=backend, receivers=len(members),
              world_size=world_size)
        return self._engine


class StorePublishing(Publishing):
    """Publishing into the cluster's weight store (`rlserve.weights.store`) and its fleet of replicas."""

    def publisher(self, backend: LearnerBackend, store_name: str, bucket_bytes: int, timeout_s: float) -> Publisher:
        return Publisher(backend, get_store(store_name), get_fleet(store_name), bucket_bytes, timeout_s)

    def drop_adapter(self, store_name: str, run_id: str) -> None:
        ray.get(get_store(store_name).drop_adapter.remote(run_id))


def trainer_init_info(backend: str, world_size: int, bucket_bytes: int, timeout_s: float):
    """vLLM's trainer init info for `backend`, rank 0 sending (the only place engine names differ)."""
    from rlserve.weights.gloo_transfer import GlooTrainerInitInfo, bind_address

    if backend == "gloo":
        return GlooTrainerInitInfo(rank=0, world_size=world_size, session=uuid.uuid4().hex,
                                   bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        from vllm.utils.network_utils import get_open_port

        return NCCLTrainerInitInfo(rank=0, master_address=bind_address(), master_port=get_open_port(),
                                   world_size=world_size)
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=0)
    raise ValueError(f"unknown weight-transfer engine {backend!r}; valid: gloo, nccl, ipc")
