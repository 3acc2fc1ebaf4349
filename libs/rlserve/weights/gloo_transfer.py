"""A vLLM weight-transfer engine on gloo: direct learner -> engine transfer on CPU.

vLLM 0.32's weight-transfer API (`vllm/distributed/weight_transfer/`) moves
weights from a trainer straight into the inference workers: the trainer side
(`TrainerWeightTransferEngine`) drives `init_weight_transfer_engine`,
`start_weight_update`, `update_weights` and `finish_weight_update` on the
engine through a client while it sends the tensors; the worker side
(`WeightTransferEngine`) receives them and loads them with vLLM's layerwise
reload. vLLM ships `nccl` and `ipc` (GPU only). This module registers a third
engine, `gloo`, in both of vLLM's factories, so that CPU clusters (and CI) run
the same control path as GPU clusters, with only the engine name changed: the
learner registers the sending side (`register_sender`), each vLLM worker the
receiving side (`register_receiver`, from `rlserve/rollout/vllm_worker.py`).

How it moves the bytes:
- Ranks as in vLLM's NCCL engine: the sending learner rank is 0, engine
  workers follow at `rank_offset` (the client gives each engine its own). But
  instead of one group of all of them, the sender forms a two-rank gloo group
  with each worker (one rendezvous store): a worker that dies, or never
  arrives, breaks only its own link, and the others are not held up.
- Sends from rank 0 to every worker, tensor by tensor, straight from the
  exported tensor (no packing copy); the sender keeps at most `bucket_bytes`
  of tensors in flight, so its memory is bounded by one bucket, never the
  model. A worker whose link fails is dropped for the rest of the round; the
  others complete (that engine catches up from the weight store).
- The worker posts a receive for every tensor at `update_weights` and returns:
  gloo's I/O threads fill the buffers while the engine keeps generating. The
  model is touched only at `finish_weight_update`, which waits for the last
  byte and then loads (vLLM's layerwise reload, inside the receiver's
  `reload_guard`: the rollout supplies its CPU repacking there, so this
  transport needs nothing from the rollout) while the caller holds the
  engine paused. A transfer that fails leaves the old weights serving. The
  price is one model-sized staging buffer per worker.
"""

from __future__ import annotations

import datetime
import os
import socket
from abc import abstractmethod
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from rlserve.weights.specs import checked

BACKEND = "gloo"
_TAG = 7
_DEFAULT_BIND = "127.0.0.1"


def bind_address() -> str:
    """The address this process's transfer sockets bind to (RLSERVE_BIND_HOST; loopback by default)."""
    host = os.environ.get("RLSERVE_BIND_HOST", _DEFAULT_BIND)
    return socket.gethostbyname(socket.gethostname()) if host in ("", "0.0.0.0", "::", "[::]") else host


def open_link(store: TCPStore, session: str, worker_rank: int, side: int, timeout_s: float) -> ProcessGroupGloo:
    """The two-rank gloo group between the sender (side 0) and one worker, bound to this process's address."""
    opts = ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [ProcessGroupGloo.create_device(hostname=bind_address())]
    return ProcessGroupGloo(PrefixStore(f"{session}/{worker_rank}", store), side, 2, opts)


def open_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """The rendezvous store: the sender's (port 0: a free port, bound to `host` only) or a client of it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if port:
        return TCPStore(host, port, is_master=False, timeout=timeout)
    listener = socket.socket()
    listener.bind((host, 0))
    listener.listen()
    return TCPStore(host, listener.getsockname()[1], is_master=True, timeout=timeout, wait_for_workers=False,
                    master_listen_fd=listener.detach())


# --- worker side (inside vLLM's engine process) ---------------------------------------------------


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float
    # Names the rendezvous keys of one trainer session (a re-formed group gets a new one).
    session: str


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")

    def metas(self) -> list[ParamMeta]:
        return [ParamMeta(n, getattr(torch, d), tuple(s)) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Receives into staging buffers while the engine runs; loads at `finish_weight_update`.

    Abstract: a subclass says what the load runs inside (`reload_guard`).
    """

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.link: ProcessGroupGloo | None = None
        self._store: TCPStore | None = None
        self._pending: list[tuple[str, torch.Tensor, Any]] = []

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        self._store = open_store(init_info.master_address, init_info.master_port, init_info.timeout_s)
        self.link = open_link(self._store, init_info.session, rank, 1, init_info.timeout_s)

    def start_weight_update(self) -> None:
        self._pending = []

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class would synchronise an accelerator; receives here complete in gloo's threads.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.link is None:
            raise RuntimeError("gloo weight transfer is not initialised: call init_weight_transfer_engine first")
        for meta in update_info.metas():
            buf = torch.empty(meta.shape, dtype=meta.dtype)
            self._pending.append((meta.name, buf, self.link.recv([buf], 0, _TAG)))

    def finish_weight_update(self) -> None:
        """Wait for every tensor, then load them all (the caller has paused the engine)."""
        pending, self._pending = self._pending, []
        for _, _, work in pending:
            work.wait()
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        with self.reload_guard():
            initialize_layerwise_reload(self.model)
            self.model.load_weights((name, buf) for name, buf, _ in pending)
            finalize_layerwise_reload(self.model, self.model_config)

    @abstractmethod
    def reload_guard(self) -> AbstractContextManager:
        """What vLLM's layerwise reload of `self.model` runs inside (e.g. repacking the layers it
        leaves stale on some platforms)."""

    def abort(self) -> None:
        """Drop a round that cannot complete (its buffers); the model was never touched."""
        self._pending = []

    def shutdown(self) -> None:
        self._pending = []
        self.link, self._store = None, None


# --- trainer side (the learner rank that sends) ---------------------------------------------------


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    world_size: int
    session: str
    # The sender keeps at most this many bytes of tensors in flight (its memory bound).
    bucket_bytes: int = 64 * 2**20
    timeout_s: float = 120.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Rank 0 sends every tensor to every live worker; other learner ranks only join the source's gathers."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool, bucket_bytes: int):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.links: dict[int, ProcessGroupGloo] = {}
        self.failed_ranks: set[int] = set()
        self.bytes_sent = 0
        self._store: TCPStore | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     bucket_bytes=init_info.bucket_bytes)
        if not engine.is_sender:
            return engine
        host = bind_address()
        engine._store = open_store(host, 0, init_info.timeout_s)
        worker_info = GlooWeightTransferInitInfo(host, engine._store.port, 1, init_info.world_size,
                                                 init_info.timeout_s, init_info.session)
        # Each worker blocks in its link's rendezvous until this side joins, so links form on threads
        # while the client asks the workers to join; a worker that never comes only fails its own link.
        pool = ThreadPoolExecutor(max_workers=max(1, init_info.world_size - 1))
        pending = {r: pool.submit(open_link, engine._store, init_info.session, r, 0, init_info.timeout_s)
                   for r in range(1, init_info.world_size)}
        try:
            client.init_weight_transfer_engine(asdict(worker_info))
            live = set(engine._client_ranks(range(1, init_info.world_size)))
            for rank, future in pending.items():
                try:
                    engine.links[rank] = future.result() if rank in live else None
                except RuntimeError:
                    engine.failed_ranks.add(rank)
        finally:
            pool.shutdown(wait=False)
        engine.links = {r: link for r, link in engine.links.items() if link is not None}
        return engine

    def send_weights(self) -> None:
        source = self.source
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:  # join the gathers that materialise each tensor
                pass
            return
        update = GlooWeightTransferUpdateInfo([m.name for m in meta], [str(m.dtype).split(".")[-1] for m in meta],
                                              [list(m.shape) for m in meta])
        self.client.start_weight_update()
        self.client.update_weights(asdict(update))  # workers post their receives and return
        self._send(checked(source, meta))
        self.client.finish_weight_update()

    def _client_ranks(self, ranks) -> list[int]:
        """The ranks whose engine is still in the round (the client may have dropped some)."""
        live = getattr(self.client, "live_ranks", None)
        return list(ranks) if live is None else [r for r in ranks if r in set(live())]

    def _send(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        inflight: list[tuple[int, Any, torch.Tensor]] = []
        inflight_bytes = 0
        self.bytes_sent = 0
        ranks = self._client_ranks(self.links)
        for _, tensor in pairs:
            tensor = tensor.contiguous()
            live = [r for r in ranks if r not in self.failed_ranks]
            for rank in live:
                try:
                    inflight.append((rank, self.links[rank].send([tensor], 1, _TAG), tensor))
                except RuntimeError:  # that worker's link is gone; the others go on
                    self.failed_ranks.add(rank)
            nbytes = tensor.numel() * tensor.element_size()
            inflight_bytes += nbytes
            self.bytes_sent += nbytes * len(live)
            if inflight_bytes >= self.bucket_bytes:
                self._drain(inflight)
                inflight, inflight_bytes = [], 0
        self._drain(inflight)

    def _drain(self, inflight: list[tuple[int, Any, torch.Tensor]]) -> None:
        for rank, work, _ in inflight:
            try:
                work.wait()
            except RuntimeError:  # that worker's link is gone; the others go on
                self.failed_ranks.add(rank)

    def shutdown(self) -> None:
        self.links, self._store = {}, None


def register_sender() -> None:
    """Make `gloo` a weight-transfer engine name in vLLM's trainer-side factory (idempotent)."""
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)


def register_receiver(engine_cls: type[GlooWeightTransferEngine]) -> None:
    """Make `gloo` a weight-transfer engine name in vLLM's worker-side factory, built as `engine_cls`
    (idempotent: the first class registered in a process stays)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, engine_cls)
