"""LoRA runs on the shared cluster (its rollout serves adapters on the deployed base): a run with a KL
penalty trains adapters only, sends the rollout only adapters, takes its reference from the learner
with the adapters off, and ends with a PEFT adapter that `rlserve export --merge` merges; two LoRA
runs of different ranks and targets train at the same time, sharing the rollout's base and the
learner's workers, while a full-parameter run waits for them; bad LoRA values are refused naming the
key, and the cluster keeps serving."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.models import resolve_model
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import rollout_pb2, rollout_pb2_grpc
from tests.integration.conftest import plugin
from tests.integration.runs_support import (
    assert_consistent,
    assert_records_agree,
    events_until_end,
    kill_learner_worker,
    metric_events,
    spec,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]


def lora(**values) -> dict:
    return {"lora_cfg": {"enabled": True, "dim": 8, **values}}


def served_adapters(channel, run_id: str, replicas: int = 2) -> dict[str, int]:
    """Replica id -> the version of `run_id`'s adapter it holds (replicas that hold none left out), once every one
    of the test cluster's `replicas` rollout replicas has answered: Serve routes each call to one of them, and
    only the replica that took a run's last update holds its newest version (the other loads it on the run's
    next request there)."""
    stub, held, answered = rollout_pb2_grpc.RolloutStub(channel), {}, set()
    for _ in range(200):
        info = stub.GetInfo(rollout_pb2.GetInfoRequest())
        answered.add(info.replica_id)
        held.update({info.replica_id: a.version for a in info.adapters if a.run_id == run_id})
        if len(answered) == replicas:
            return held
    raise AssertionError(f"200 GetInfo calls reached only the replicas {sorted(answered)}")


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
    assert_consistent(steps)  # vLLM (CPU, fp32), dense, LoRA, one turn
    held = served_adapters(channel, run.run_id)
    # The last publication was loaded by one replica at once; another loads it at the run's next request there.
    assert run.weight_version in held.values() and max(held.values()) == run.weight_version

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


def test_two_lora_runs_train_at_once_and_a_full_run_waits_for_them(client, channel):
    """A third LoRA run beside them, whose reward plug-in raises on every item, fails alone; a fourth,
    cancelled after its first step, drops only its own samples in flight (its ledger balances, the
    others have no `cancelled` drops)."""
    # The first run is the longer, so that the second's steps fall among its steps even when the second starts
    # seconds later (its adapter configured beside the first's, on a loaded machine: 5 s after, once).
    first = client.submit(spec(policy__dtensor_cfg=lora(), grpo__max_num_steps=10), run_id="itest-lora-a")
    second = client.submit(spec(policy__dtensor_cfg=lora(dim=4, target_modules=["q_proj", "v_proj"],
                                                         match_all_linear=False), grpo__max_num_steps=4),
                           run_id="itest-lora-b")
    broken = client.submit(spec(policy__dtensor_cfg=lora(), grpo__max_num_steps=2, checkpointing__enabled=False,
                                reward__functions=[{"name": "broken", "import_path": plugin("broken")}]),
                           run_id="itest-lora-broken")
    cancelled = client.submit(spec(policy__dtensor_cfg=lora(dim=2), grpo__max_num_steps=200, grpo__val_period=0,
                                   checkpointing__enabled=False,
                                   grpo__async_grpo={"enabled": True, "max_trajectory_age_steps": 1}),
                              run_id="itest-lora-cancelled")
    full = client.submit(spec(grpo__max_num_steps=1), run_id="itest-after-lora")
    wait_for(client, cancelled.run_id, pb.EVENT_KIND_STEP)
    client.cancel(cancelled.run_id)
    runs = {r: events_until_end(client, r, timeout_s=600) for r in (first.run_id, second.run_id, full.run_id)}
    failed = client.get(broken.run_id)
    assert failed.state == pb.RUN_STATE_FAILED and failed.error.startswith("the run trained nothing")
    assert_records_agree(failed, events_until_end(client, broken.run_id))
    stopped = client.get(cancelled.run_id)
    assert stopped.state == pb.RUN_STATE_CANCELLED  # what it had in flight (if anything, by then) dropped
    assert_records_agree(stopped, events_until_end(client, cancelled.run_id))
    steps = {}
    for run_id, events in runs.items():
        run = client.get(run_id)
        assert run.state == pb.RUN_STATE_SUCCEEDED, (run_id, run.error)
        assert_records_agree(run, events)
        assert not run.ledger.dropped.get("cancelled") and not run.ledger.dropped.get("reward_error")
        steps[run_id] = [ev.time_unix for ev in events if ev.kind == pb.EVENT_KIND_STEP]
    a, b = steps[first.run_id], steps[second.run_id]
    assert a[0] < b[-1] and b[0] < a[-1]  # the LoRA runs' steps interleave: they trained at the same time
    started = next(ev.time_unix for ev in runs[full.run_id] if ev.state == pb.RUN_STATE_RUNNING)
    assert started >= max(a[-1], b[-1])  # the full-parameter run started once both had ended
    shared = []
    for run_id in (first.run_id, second.run_id):  # each run's own adapter, at its own versions
        run = client.get(run_id)
        held = served_adapters(channel, run_id)
        assert held and max(held.values()) == run.weight_version
        ready = next(ev.message for ev in runs[run_id] if ev.message.startswith("learner ready"))
        shared.append("frozen base shared with other runs" in ready)
    assert sorted(shared) == [False, True]  # the run configured second holds no base of its own


def test_a_shared_learner_worker_killed_mid_run_heals_and_both_runs_go_on(client):
    """The learner starts new workers, configures both runs again, restores each from its snapshot and
    retries the call the death interrupted: neither run notices beyond a pause (no RECOVERED event, no
    step lost or trained twice)."""
    steps = 8
    common = dict(grpo__max_num_steps=steps, grpo__val_period=0, grpo__val_at_start=False,
                  logger__plot_enabled=False, checkpointing__enabled=False)
    first = client.submit(spec(policy__dtensor_cfg=lora(), **common), run_id="itest-heal-a")
    second = client.submit(spec(policy__dtensor_cfg=lora(dim=4), **common), run_id="itest-heal-b")
    for run_id in (first.run_id, second.run_id):  # both have trained, neither has ended
        wait_for(client, run_id, pb.EVENT_KIND_STEP, where=lambda ev: ev.step == 2)
    killed = kill_learner_worker()
    killed_at = time.time()
    at_kill = {run_id: client.get(run_id).step for run_id in (first.run_id, second.run_id)}
    trained_after = {}
    for run_id in (first.run_id, second.run_id):
        events = events_until_end(client, run_id, timeout_s=600)
        run = client.get(run_id)
        assert run.state == pb.RUN_STATE_SUCCEEDED, (run_id, run.error)
        assert not [ev for ev in events if ev.kind == pb.EVENT_KIND_RECOVERED], run_id
        assert run.weight_version == run.step == steps  # every step trained once
        trained_after[run_id] = [ev.step for ev in events if ev.kind == pb.EVENT_KIND_STEP and ev.time_unix > killed_at]
        assert_records_agree(run, events)
    assert all(trained_after.values()), (trained_after, at_kill)  # both went on, on the new worker
    assert killed not in [p.pid for p in psutil.process_iter()]


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
