"""The same-device weight handoff (`rlserve.weights.handoff`) on the CPU, between real processes: a producer
packs a bucket into a shared-memory file, two receiver processes map it and stage the tensors, and the
staged tensors equal the producer's bit for bit. The CUDA IPC side needs a GPU
(tests/gpu/test_cuda_handoff.py); the packing is the same for both."""

from __future__ import annotations

import os
import stat

import pytest
import torch
import torch.multiprocessing as mp

from rlserve.weights import handoff
from rlserve.weights.handoff import HandoffReceiver, HandoffSender, device_identity, pack, unpack

CPU = torch.device("cpu")


def test_pack_then_unpack_gives_every_tensor_back_bit_exact_and_aligned():
    g = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
               ("b", torch.randn(7, generator=g)),
               ("c", torch.randint(0, 100, (2, 3, 4), generator=g, dtype=torch.int64)),
               ("d", torch.randn(1, generator=g).to(torch.float16))]
    flat, layout = pack(tensors, lambda n: torch.empty(n, dtype=torch.uint8))
    assert flat.dtype == torch.uint8
    assert [entry[0] for entry in layout] == ["a", "b", "c", "d"]
    assert all(offset % 256 == 0 for *_, offset in layout)
    back = dict(unpack(flat, layout))
    for name, t in tensors:
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name].view(torch.uint8), t.view(torch.uint8)), name


def _receiver(identity: str, inbox, outbox) -> None:
    receiver = HandoffReceiver(CPU)
    receiver.init({"device": identity})
    receiver.start()
    while (info := inbox.get()) is not None:
        receiver.receive(info)
        outbox.put("copied")
    # As bytes: a tensor through a queue is itself shared by torch, and this process ends next.
    outbox.put({name: t.contiguous().view(torch.uint8).numpy().tobytes() for name, t in receiver.take().items()})


class _Fleet:
    """The publisher's fleet client as the sender sees it, delivering to receiver processes (no Ray here:
    the fleet's own path is tested by the integration tests on the default cluster)."""

    def __init__(self, boxes):
        self.boxes = boxes
        self.files: list[str] = []
        self.lasts: list[bool] = []
        self.finished_alone = False

    def init_weight_transfer_engine(self, info: dict) -> None:
        self.init_info = info

    def start_weight_update(self) -> None:
        pass

    def live_members(self) -> list[int]:
        return list(range(len(self.boxes)))

    def update_weights_each(self, infos: dict, last: bool = False) -> None:
        self.lasts.append(last)
        for member, info in infos.items():
            path = info["handle"]["file"]
            self.files.append(path)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "a bucket other local users could read"
            self.boxes[member][0].put(info)
        for _, outbox in self.boxes:
            assert outbox.get(timeout=120) == "copied"

    def finish_weight_update(self) -> None:
        self.finished_alone = True


class _Source:
    def __init__(self, tensors):
        self.tensors = tensors

    def metadata(self):
        return None


def test_two_receiver_processes_stage_every_bucket_bit_exact_and_no_file_is_left(monkeypatch):
    g = torch.Generator().manual_seed(0)
    tensors = [("model.embed_tokens.weight", torch.randn(1000, 64, generator=g).to(torch.bfloat16)),
               ("model.norm.weight", torch.randn(64, generator=g)),
               ("lm_head.weight", torch.randn(1000, 64, generator=g))]
    # `checked` validates against the served checkpoint in the publisher; here the source is the list itself.
    monkeypatch.setattr(handoff, "checked", lambda source, meta: iter(source.tensors))
    ctx = mp.get_context("spawn")
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    procs = [ctx.Process(target=_receiver, args=(device_identity(CPU), inbox, outbox)) for inbox, outbox in boxes]
    for p in procs:
        p.start()
    try:
        fleet = _Fleet(boxes)
        # A bucket smaller than the model: two buckets (the embedding and the norm, then the head), a file each.
        sender = HandoffSender.trainer_init(fleet, _Source(tensors), 200_000, CPU)
        assert fleet.init_info == {"device": device_identity(CPU)}
        sender.send_weights()
        for inbox, _ in boxes:
            inbox.put(None)
        staged = [outbox.get(timeout=120) for _, outbox in boxes]
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert len(set(fleet.files)) == 2
    # The round's finish travelled with its last bucket.
    assert fleet.lasts == [False, True] and not fleet.finished_alone
    assert not any(os.path.exists(f) for f in fleet.files), "a bucket's shared-memory file outlived its round"
    for got in staged:
        for name, t in tensors:
            assert got[name] == t.contiguous().view(torch.uint8).numpy().tobytes(), name
    assert sender.bytes_sent == 2 * sum(t.numel() * t.element_size() for _, t in tensors)


def test_a_receiver_on_another_host_refuses_the_round():
    receiver = HandoffReceiver(CPU)
    with pytest.raises(RuntimeError, match="one device only"):
        receiver.init({"device": "host elsewhere boot 0"})
    with pytest.raises(RuntimeError, match="init first"):
        receiver.start()


def test_a_dead_senders_bucket_files_are_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(handoff, "shm_dir", lambda: tmp_path)
    ctx = mp.get_context("spawn")
    gone = ctx.Process(target=int)
    gone.start()
    gone.join()
    stale = tmp_path / f"rlserve-handoff-{gone.pid}-{'0' * 32}"
    live = tmp_path / f"rlserve-handoff-{os.getpid()}-{'1' * 32}"
    other = tmp_path / "someone-elses-file"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    assert handoff.sweep_stale_buckets() == 1
    assert not stale.exists() and live.exists() and other.exists()
