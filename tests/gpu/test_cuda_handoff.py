"""GPU-only: the same-GPU weight handoff (`rlserve.weights.handoff`) between real processes. A producer
hands two receiver processes one packed bucket each through their own CUDA IPC handles; each receiver's
staged tensors must equal the producer's bit for bit, and once both let go the producer's block is freed
(torch's per-handle reference count balances: a leak here would cost a model's worth of GPU memory per
step). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from rlserve.weights.handoff import HandoffReceiver, device_identity, pack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (GPU-only test)")]


def _receiver(uuid: str, inbox, outbox) -> None:
    receiver = HandoffReceiver(torch.device("cuda", 0))
    receiver.init({"device": uuid})
    receiver.start()
    receiver.receive(inbox.get())
    outbox.put({name: t.cpu() for name, t in receiver.take().items()})
    inbox.get()  # hold the CUDA context until the producer has checked


def test_two_receivers_stage_the_bucket_bit_exact_and_the_block_is_freed():
    device = torch.device("cuda", 0)
    g = torch.Generator(device=device).manual_seed(0)
    tensors = [("model.embed_tokens.weight", torch.randn(1000, 64, device=device, generator=g).to(torch.bfloat16)),
               ("model.norm.weight", torch.randn(64, device=device, generator=g)),
               ("lm_head.weight", torch.randn(1000, 64, device=device, generator=g).to(torch.bfloat16))]
    ctx = mp.get_context("spawn")
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    procs = [ctx.Process(target=_receiver, args=(device_identity(device), inbox, outbox)) for inbox, outbox in boxes]
    for p in procs:
        p.start()
    try:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated(device)
        flat, layout = pack(tensors, lambda n: torch.empty(n, dtype=torch.uint8, device=device))
        torch.cuda.synchronize()
        from torch.multiprocessing.reductions import reduce_tensor

        info = {"names": [n for n, _ in tensors], "layout": layout, "bucket": True}
        for inbox, _ in boxes:  # one handle per receiver
            inbox.put({**info, "handle": {"cuda": list(reduce_tensor(flat)[1])}})
        staged = [outbox.get(timeout=120) for _, outbox in boxes]
        for got in staged:
            for name, t in tensors:
                assert torch.equal(got[name].view(torch.uint8), t.cpu().view(torch.uint8)), name
        del flat
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated(device) == baseline, "the handed-over block was not freed"
    finally:
        for inbox, _ in boxes:
            inbox.put(None)
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)


def test_a_receiver_on_another_gpu_refuses_the_round():
    receiver = HandoffReceiver(torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="one device only"):
        receiver.init({"device": "GPU-elsewhere"})
    with pytest.raises(RuntimeError, match="init first"):
        receiver.start()
