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


def lora_run(backend_name: str, init_adapter, steps: int = 4) -> tuple[list[float], bool]:
    """bf16 SFT steps with LoRA from `init_adapter`: the losses, and whether only adapters moved."""
    from rlserve.learner import make_backend

    lora = {"enabled": True, "dim": 8, "dropout": 0.0}
    policy = {"precision": "bfloat16", "max_total_sequence_length": 64, "generation": {"max_new_tokens": 8}}
    policy["megatron_cfg" if backend_name == "megatron" else "dtensor_cfg"] = (
        {"enabled": True, "peft": lora} if backend_name == "megatron" else {"lora_cfg": lora})
    backend = make_backend(parse_spec({"policy": policy, "cluster": {"device": "cuda"}}),
                           resolve_model("preset:tiny"), torch.device("cuda", 0), init_adapter)
    model = backend.gpt if backend_name == "megatron" else backend.model
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    batch = TrainBatch.from_sequences([[8, 11, 41, 12, 9, 47, 6, 7, 5, 2]] * 16, [6] * 16)
    losses = [backend.train_step(batch, "sft", 1e-3).metrics["loss/total"] for _ in range(steps)]
    base_same = all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    return losses, base_same


def test_lora_trains_on_both_backends_in_bf16_and_they_agree(process_group, tmp_path):
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        pytest.skip("megatron-core is not installed")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(resolve_model("preset:tiny"), dtype=torch.float32)
    tuned = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if ".lora_B." in name:
                param.mul_(0.05)
    tuned.save_pretrained(tmp_path / "init")
    dtensor, dtensor_base_same = lora_run("dtensor", tmp_path / "init")
    megatron, megatron_base_same = lora_run("megatron", tmp_path / "init")
    assert dtensor_base_same and megatron_base_same
    assert dtensor[-1] < dtensor[0] and all(torch.isfinite(torch.tensor(megatron)))
    assert megatron == pytest.approx(dtensor, rel=0.05, abs=0.02)
