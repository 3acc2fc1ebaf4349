"""LoRA runs on the shared cluster (its rollout serves adapters on the deployed base): a run with a KL
penalty trains adapters only, sends the rollout only adapters, takes its reference from the learner
with the adapters off, and ends with a PEFT adapter that `rlserve export --merge` merges; bad LoRA
values are refused naming the key, and the cluster keeps serving."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.models import resolve_model
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import rollout_pb2, rollout_pb2_grpc
from tests.integration.runs_support import assert_records_agree, events_until_end, metric_events, spec

REPO = Path(__file__).resolve().parents[2]


def lora(**values) -> dict:
    return {"lora_cfg": {"enabled": True, "dim": 8, **values}}


@pytest.fixture(scope="module")
def client(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as c:
        yield c


def test_a_lora_run_sends_adapters_only_and_ends_with_a_peft_adapter(client, channel, test_cluster):
    run = client.submit(spec(policy__dtensor_cfg=lora(), policy__optimizer={"kwargs": {"lr": 1e-3}},
                             loss_fn={"reference_policy_kl_penalty": 0.05}), run_id="itest-lora")
    events = events_until_end(client, run.run_id)
    run = client.get(run.run_id)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    assert_records_agree(run, events)
    steps = metric_events(events)
    assert all(m["weight_sync/mib"] < 0.1 * m["weight_sync/model_mib"] for m in steps)  # adapters, not the model
    assert all(m["weight_sync/direct_mib"] == 0 for m in steps)  # through the store: vLLM loads adapters by folder
    assert "policy/reference_kl" in steps[-1] and steps[-1]["policy/reference_kl"] > 0  # the learner's reference
    infos = {}
    stub = rollout_pb2_grpc.RolloutStub(channel)
    for _ in range(8):
        info = stub.GetInfo(rollout_pb2.GetInfoRequest())
        infos[info.replica_id] = (info.run_id, info.weight_version)
    assert set(infos.values()) == {(run.run_id, run.weight_version)}  # every replica serves the adapter

    final = Path(run.final_model_path)
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    merged = final.parent / "merged"
    subprocess.run([sys.executable, "-m", "rlserve.cli", "export", str(final.parent), "--merge", "--out", str(merged)],
                   check=True, cwd=REPO, capture_output=True)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[8, 11, 41, 12, 9]])
    base = AutoModelForCausalLM.from_pretrained(resolve_model("preset:tiny"), dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(ids).logits
        tuned = PeftModel.from_pretrained(base, final).eval()(ids).logits
        flat = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(flat, tuned, atol=1e-4, rtol=0)
    assert (tuned - base_logits).abs().max() > 1e-4


@pytest.mark.parametrize("section, field, needle", [
    (lora(dim=17), "lora_cfg.dim", "max_lora_rank 16"),
    (lora(dim=100), "lora_cfg.dim", "exceeds the width of k_proj"),
    (lora(target_modules=["qkv"], match_all_linear=False), "lora_cfg.target_modules", "'qkv' is not a linear layer"),
    (lora(dim=0), "lora_cfg.dim", "greater than or equal to 1"),
])
def test_bad_lora_values_are_refused_naming_the_key(client, section, field, needle):
    with pytest.raises(grpc.RpcError) as err:
        client.submit(spec(policy__dtensor_cfg=section))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"policy.dtensor_cfg.{field}" in err.value.details() and needle in err.value.details()
    assert client.list() is not None  # the coordinator keeps serving
