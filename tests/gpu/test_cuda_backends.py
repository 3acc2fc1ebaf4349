"""GPU-only: both learner backends train in bf16 on CUDA (NCCL, one rank) and agree with each
other within bf16 noise. Skipped without CUDA (see tests/conftest.py)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from rlserve.config import parse_spec
from rlserve.models import resolve_model
from rlserve.training.batch import TrainBatch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    from rlserve.training.distributed import init_process_group

    if not dist.is_initialized():
        init_process_group(0, 1, f"file://{tempfile.mktemp()}", torch.device("cuda", 0))
    yield


def sft_losses(backend_name: str, steps: int = 6) -> list[float]:
    from rlserve.learner import make_backend

    policy = {"precision": "bfloat16", "max_total_sequence_length": 64, "generation": {"max_new_tokens": 8}}
    if backend_name == "megatron":
        policy["megatron_cfg"] = {"enabled": True}
    backend = make_backend(parse_spec({"policy": policy, "cluster": {"device": "cuda"}}),
                           resolve_model("preset:tiny"), torch.device("cuda", 0))
    batch = TrainBatch.from_sequences([[8, 11, 41, 12, 9, 47, 6, 7, 5, 2]] * 16, [6] * 16)
    return [backend.train_step(batch, "sft", 1e-3).metrics["loss/total"] for _ in range(steps)]


def test_backends_train_in_bf16_and_agree(process_group):
    dtensor = sft_losses("dtensor")
    assert all(torch.isfinite(torch.tensor(dtensor))) and dtensor[-1] < dtensor[0] * 0.5
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        pytest.skip("megatron-core is not installed")
    megatron = sft_losses("megatron")
    assert megatron == pytest.approx(dtensor, rel=0.05, abs=0.02)
