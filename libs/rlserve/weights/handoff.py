"""Same-device weight handoff: the learner hands each bucket to the engines that share its device.

Where a rollout engine shares the learner's device (every service on one GPU,
`examples/cluster_gpu_one.yaml`, or every service on this CPU machine, the
default cluster; rollout `weight_transfer: ipc` with the transformers engine),
a new version never goes through the object store on the step's path. Rank 0
packs a bucket of exported tensors into one flat buffer that the engines can
open: on a GPU, device memory shared by CUDA IPC (torch's `reduce_tensor`,
once per receiver: torch counts one consumer per handle and keeps the block
until that consumer lets go); on the CPU, a file in shared memory
(`/dev/shm`, mode 0600) that each engine maps. The engine copies the bytes
into a staging buffer before it answers; then the sender drops the bucket
(on the CPU, unlinks the file) and packs the next. The model is touched only
at `finish`, under the engine's lock, so generation goes on while the bytes
arrive and a round that fails leaves the old weights serving.

Costs: one bucket on the sender, one model-sized staging buffer on the
receiver, two copies on the device. Same control path as `gloo_transfer`
(the publisher's fleet client drives init and an update per bucket, the
round's start riding on the first and its finish on the last), without vLLM: the nodes that use
it run the transformers engine. Handles only open where they were made, so
`init` carries the sender's device identity (the GPU's UUID, or this boot of
this host) and an engine elsewhere refuses the round (it then catches up
from the weight store).
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from rlserve.weights.buckets import tensor_bytes
from rlserve.weights.specs import checked

BACKEND = "handoff"
# Tensors start at multiples of this in a packed bucket, so every dtype's view of its slice is aligned.
_ALIGN = 256
# Where the producer's device index sits in `reduce_tensor`'s rebuild arguments.
_DEVICE_ARG = 6
# A CPU bucket's file: the sender's pid first, so a sender can sweep what a dead one left behind.
_SHM_NAME = re.compile(r"rlserve-handoff-(\d+)-[0-9a-f]+$")


def device_identity(device: torch.device) -> str:
    """Where a handle opens: the GPU (its UUID), or the host this boot (shared memory is per host)."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"host {socket.gethostname()} boot {boot.read_text().strip() if boot.exists() else '?'}"


def shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def pack(tensors: list[tuple[str, torch.Tensor]], alloc: Callable[[int], torch.Tensor]
         ) -> tuple[torch.Tensor, list[list]]:
    """One flat uint8 buffer from `alloc(nbytes)` holding `tensors`, and the layout [name, dtype name, shape,
    offset] of each."""
    flat = alloc(sum(_aligned(tensor_bytes(t)) for _, t in tensors))
    layout, offset = [], 0
    for name, t in tensors:
        n = tensor_bytes(t)
        flat[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
        layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset += _aligned(n)
    return flat, layout


def unpack(flat: torch.Tensor, layout: list[list]) -> Iterable[tuple[str, torch.Tensor]]:
    """Views of `flat` as the tensors `pack` put there."""
    for name, dtype_name, shape, offset in layout:
        dtype = getattr(torch, dtype_name)
        n = dtype.itemsize * (int(torch.Size(shape).numel()))
        yield name, flat[offset:offset + n].view(dtype).view(shape)


class _SharedFile:
    """A CPU bucket: a file in shared memory, mapped by the sender and by each receiver."""

    def __init__(self) -> None:
        self.path = shm_dir() / f"rlserve-handoff-{os.getpid()}-{uuid.uuid4().hex}"

    def alloc(self, nbytes: int) -> torch.Tensor:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # weights: the owner only
        try:
            os.ftruncate(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        return torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.uint8)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def sweep_stale_buckets() -> int:
    """Unlink bucket files whose sender is gone (a learner killed mid-round); returns how many."""
    swept = 0
    for f in shm_dir().glob("rlserve-handoff-*"):
        m = _SHM_NAME.match(f.name)
        if m and not _alive(int(m.group(1))):
            f.unlink(missing_ok=True)
            swept += 1
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HandoffSender:
    """Rank 0's side of a round; the publisher's `FleetClient` reaches the engines."""

    def __init__(self, client: Any, source: Any, bucket_bytes: int, device: torch.device):
        self.client, self.source, self.bucket_bytes, self.device = client, source, bucket_bytes, device
        self.bytes_sent = 0
        self.failed_ranks: set[int] = set()  # the fleet client drops failed engines itself

    @classmethod
    def trainer_init(cls, client: Any, source: Any, bucket_bytes: int, device: torch.device) -> HandoffSender:
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"a weight handoff needs the learner on a GPU or the CPU, not {device}")
        if device.type == "cpu":
            sweep_stale_buckets()
        client.init_weight_transfer_engine({"device": device_identity(device)})
        return cls(client, source, bucket_bytes, device)

    def send_weights(self) -> None:
        self.bytes_sent = 0
        self.client.start_weight_update()
        buckets = self._buckets()
        # One bucket is held back, so the round's finish travels with its last (one round trip fewer).
        pending = next(buckets, None)
        for bucket in buckets:
            self._hand_over(pending)
            pending = bucket
        if pending is None:
            self.client.finish_weight_update()
        else:
            self._hand_over(pending, last=True)

    def _buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in checked(self.source, self.source.metadata()):
            if bucket and size + _aligned(tensor_bytes(tensor)) > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += _aligned(tensor_bytes(tensor))
        if bucket:
            yield bucket

    def shutdown(self) -> None:
        """Nothing outlives a round: each bucket is freed once its receivers copied it."""

    def _hand_over(self, bucket: list[tuple[str, torch.Tensor]], last: bool = False) -> None:
        members = self.client.live_members()
        names = [name for name, _ in bucket]
        if self.device.type == "cuda":
            flat, layout = pack(bucket, lambda n: torch.empty(n, dtype=torch.uint8, device=self.device))
            torch.cuda.current_stream(self.device).synchronize()
            handles = {m: {"cuda": list(reduce_tensor(flat)[1])} for m in members}
            release = lambda: None  # noqa: E731 - the block goes when the last handle and `flat` are gone
        else:
            shared = _SharedFile()
            flat, layout = pack(bucket, shared.alloc)
            handles = {m: {"file": str(shared.path), "nbytes": flat.numel()} for m in members}
            release = shared.release
        # `bucket`: these names are one part of the round (the follower checks the whole at finish).
        info = {"names": names, "dtype_names": [d for _, d, _, _ in layout], "shapes": [s for _, _, s, _ in layout],
                "layout": layout, "bucket": True}
        try:
            # Each receiver copies before it answers; only then may the buffer go.
            self.client.update_weights_each({m: {**info, "handle": handles[m]} for m in members}, last=last)
        finally:
            del flat
            release()
        self.bytes_sent += sum(tensor_bytes(t) for _, t in bucket) * len(members)


class HandoffReceiver:
    """An engine's side: opens each bucket's handle and copies the tensors out into staging."""

    def __init__(self, device: torch.device):
        self.device = device
        self.ready = False
        self.staged: dict[str, torch.Tensor] = {}

    def init(self, init_info: dict) -> None:
        ours = device_identity(self.device)
        if init_info.get("device") != ours:
            self.ready = False
            raise RuntimeError(f"the learner's device ({init_info.get('device')}) is not this engine's ({ours}): "
                               f"a weight handoff works on one device only")
        self.ready = True

    def start(self) -> None:
        if not self.ready:
            raise RuntimeError("no weight handoff was set up with this engine (init first)")
        self.staged = {}

    def receive(self, update_info: dict) -> None:
        handle = update_info["handle"]
        if "cuda" in handle:
            args = list(handle["cuda"])
            args[_DEVICE_ARG] = self.device.index if self.device.index is not None else torch.cuda.current_device()
            flat = rebuild_cuda_tensor(*args)
        else:
            flat = torch.from_file(handle["file"], shared=True, size=handle["nbytes"], dtype=torch.uint8)
        self.staged.update({name: view.clone() for name, view in unpack(flat, update_info["layout"])})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        del flat  # releases the handle (or the mapping): the sender may free the block

    def take(self) -> dict[str, torch.Tensor]:
        staged, self.staged = self.staged, {}
        return staged

    def abort(self) -> None:
        self.staged = {}
