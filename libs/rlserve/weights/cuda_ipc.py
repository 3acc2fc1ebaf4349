"""Same-GPU weight handoff: the learner hands each bucket to the engines on its own GPU by CUDA IPC.

Where a rollout engine shares the learner's GPU (every service on one GPU,
`examples/cluster_gpu_one.yaml`, rollout `weight_transfer: ipc`), a new
version never leaves the device. Rank 0 packs a bucket of exported tensors
into one flat device buffer and gives each engine its own CUDA IPC handle to
it (torch's `reduce_tensor`, once per receiver: torch counts one consumer per
handle and keeps the block until that consumer lets go). The engine copies the
bytes into a staging buffer on the same device before it answers; then the
sender drops the bucket and packs the next. The model is touched only at
`finish`, under the engine's lock, so generation goes on while the bytes
arrive and a round that fails leaves the old weights serving.

Costs: one bucket on the sender, one model-sized staging buffer on the
receiver, two device-to-device copies. Same control path as
`gloo_transfer` (the publisher's fleet client drives init, start, an update
per bucket, finish), without vLLM: the GPU nodes that use it run the
transformers engine. Handles only open on the GPU that made them, so `init`
carries the sender's device UUID and an engine on another GPU refuses the
round (it then catches up from the weight store).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from rlserve.weights.buckets import tensor_bytes
from rlserve.weights.specs import checked

BACKEND = "cuda_ipc"
# Tensors start at multiples of this in a packed bucket, so every dtype's view of its slice is aligned.
_ALIGN = 256
# Where the producer's device index sits in `reduce_tensor`'s rebuild arguments.
_DEVICE_ARG = 6


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def pack(tensors: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, list[list]]:
    """One flat uint8 buffer holding `tensors`, and the layout [name, dtype name, shape, offset] of each."""
    flat = torch.empty(sum(_aligned(tensor_bytes(t)) for _, t in tensors), dtype=torch.uint8, device=device)
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


class CudaIpcSender:
    """Rank 0's side of a round; the publisher's `FleetClient` reaches the engines."""

    def __init__(self, client: Any, source: Any, bucket_bytes: int, device: torch.device):
        self.client, self.source, self.bucket_bytes, self.device = client, source, bucket_bytes, device
        self.bytes_sent = 0
        self.failed_ranks: set[int] = set()  # the fleet client drops failed engines itself

    @classmethod
    def trainer_init(cls, client: Any, source: Any, bucket_bytes: int, device: torch.device) -> CudaIpcSender:
        if device.type != "cuda":
            raise ValueError(f"a CUDA IPC handoff needs the learner on a GPU, not {device}")
        client.init_weight_transfer_engine({"device_uuid": device_uuid(device)})
        return cls(client, source, bucket_bytes, device)

    def send_weights(self) -> None:
        meta = self.source.metadata()
        self.bytes_sent = 0
        self.client.start_weight_update()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in checked(self.source, meta):
            if bucket and size + _aligned(tensor_bytes(tensor)) > self.bucket_bytes:
                self._hand_over(bucket)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += _aligned(tensor_bytes(tensor))
        if bucket:
            self._hand_over(bucket)
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        """Nothing outlives a round: each bucket is freed once its receivers copied it."""

    def _hand_over(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        flat, layout = pack(bucket, self.device)
        torch.cuda.current_stream(self.device).synchronize()
        members = self.client.live_members()
        names = [name for name, _ in bucket]
        # `bucket`: these names are one part of the round (the follower checks the whole at finish).
        info = {"names": names, "dtype_names": [d for _, d, _, _ in layout], "shapes": [s for _, _, s, _ in layout],
                "layout": layout, "bucket": True}
        # Each receiver copies before it answers; only then may the buffer go.
        self.client.update_weights_each({m: {**info, "handle": list(reduce_tensor(flat)[1])} for m in members})
        self.bytes_sent += flat.numel() * len(members)


class CudaIpcReceiver:
    """An engine's side: opens each bucket's handle and copies the tensors out into staging."""

    def __init__(self, device: torch.device):
        self.device = device
        self.ready = False
        self.staged: dict[str, torch.Tensor] = {}

    def init(self, init_info: dict) -> None:
        ours = device_uuid(self.device)
        if init_info.get("device_uuid") != ours:
            self.ready = False
            raise RuntimeError(f"the learner's GPU ({init_info.get('device_uuid')}) is not this engine's ({ours}): "
                               f"a CUDA IPC handoff works on one GPU only")
        self.ready = True

    def start(self) -> None:
        if not self.ready:
            raise RuntimeError("no CUDA IPC handoff was set up with this engine (init first)")
        self.staged = {}

    def receive(self, update_info: dict) -> None:
        args = list(update_info["handle"])
        args[_DEVICE_ARG] = self.device.index if self.device.index is not None else torch.cuda.current_device()
        flat = rebuild_cuda_tensor(*args)
        self.staged.update({name: view.clone() for name, view in unpack(flat, update_info["layout"])})
        torch.cuda.synchronize(self.device)
        del flat  # releases the handle: the sender may free the block

    def take(self) -> dict[str, torch.Tensor]:
        staged, self.staged = self.staged, {}
        return staged

    def abort(self) -> None:
        self.staged = {}
