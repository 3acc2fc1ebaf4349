"""The packing a CUDA IPC handoff uses (`rlserve.weights.cuda_ipc`), on CPU tensors: the handoff itself
needs a GPU (tests/gpu/test_cuda_ipc.py)."""

from __future__ import annotations

import torch

from rlserve.weights.cuda_ipc import pack, unpack


def test_pack_then_unpack_gives_every_tensor_back_bit_exact_and_aligned():
    g = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
               ("b", torch.randn(7, generator=g)),
               ("c", torch.randint(0, 100, (2, 3, 4), generator=g, dtype=torch.int64)),
               ("d", torch.randn(1, generator=g).to(torch.float16))]
    flat, layout = pack(tensors, torch.device("cpu"))
    assert flat.dtype == torch.uint8
    assert [entry[0] for entry in layout] == ["a", "b", "c", "d"]
    assert all(offset % 256 == 0 for *_, offset in layout)
    back = dict(unpack(flat, layout))
    for name, t in tensors:
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name].view(torch.uint8), t.view(torch.uint8)), name
