"""The coordinator end to end on the shared cluster: runs complete with a balanced ledger, the
staleness bound holds, cancel works, bad specs are refused, an external reward server stands in
for the reward service, and the client CLI exits with the run's outcome."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import (
    assert_consistent,
    assert_records_agree,
    events_until_end,
    metric_events,
    spec,
    wait_for,
)
from tests.support.dist import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def client(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as c:
        yield c


def kinds(events) -> set[int]:
    return {ev.kind for ev in events}


def test_short_run_completes_with_a_balanced_ledger(client):
    run = client.submit(spec(), run_id="itest-basic")
    events = events_until_end(client, run.run_id)
    run = client.get(run.run_id)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    assert run.ledger.generated == 3 * 8 * 4 and run.ledger.trained > 0
    assert_records_agree(run, events)
    assert {pb.EVENT_KIND_STATE, pb.EVENT_KIND_STEP, pb.EVENT_KIND_WEIGHT_SYNC, pb.EVENT_KIND_VALIDATION,
            pb.EVENT_KIND_CHECKPOINT} <= kinds(events)
    steps = metric_events(events)
    assert [int(ev.step) for ev in events if ev.kind == pb.EVENT_KIND_STEP] == [1, 2, 3]
    assert all(m["batch/staleness_max"] == 0 for m in steps)
    assert "loss/total" in steps[0] and "timing/generate_s" in steps[0] and "val/reward" in steps[-1]
    assert_consistent(steps)  # vLLM (CPU, fp32), dense, full weights, one turn
    usage = run.usage  # the sum of the steps' spend; every completion has at least one token
    assert usage.generated_tokens == sum(m["usage/generated_tokens"] for m in steps) >= run.ledger.generated
    assert usage.trained_tokens == sum(m["usage/trained_tokens"] for m in steps) > 0
    assert usage.training_device_seconds > 0 and usage.generation_device_seconds > 0
    run_dir = Path(run.run_dir)
    for name in ("spec.yaml", "run.json", "events.jsonl", "metrics.jsonl", "reward_curve.png",
                 "checkpoints/step_000002/coordinator.json", "final_model/model.safetensors"):
        assert (run_dir / name).exists(), name
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((run_dir / "run.json").read_text())["state"] == "succeeded"
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    assert model(torch.tensor([[8, 11, 41]])).logits.shape[-1] == model.config.vocab_size


@pytest.mark.parametrize("max_age, in_flight", [(0, True), (2, False), (1, True)])
def test_no_trained_group_is_older_than_the_bound(client, max_age, in_flight):
    """Step-level async, and streaming with in-flight updates (a sample's age is its oldest version's):
    nothing older than the bound is trained, so with the bound at 0 nothing mixed is."""
    run = client.submit(spec(grpo__max_num_steps=5, grpo__val_period=0, checkpointing__enabled=False,
                             grpo__async_grpo={"enabled": True, "max_trajectory_age_steps": max_age,
                                               "in_flight_weight_updates": in_flight, "streaming": in_flight,
                                               "max_prompts_in_flight": 4}))
    events = events_until_end(client, run.run_id)
    assert client.get(run.run_id).state == pb.RUN_STATE_SUCCEEDED
    steps = metric_events(events)
    staleness = [m["batch/staleness_max"] for m in steps]
    assert len(staleness) == 5 and max(staleness) <= max_age
    if max_age:
        assert max(staleness) >= 1, "with max_age > 0 generation should run ahead of training"
    else:
        assert all(m["batch/mixed_version_samples"] == 0 and m["batch/version_spread_max"] == 0 for m in steps)
    assert all(m["batch/version_spread_max"] <= max_age for m in steps)
    idle = [m["engine/idle_fraction"] for m in steps if "engine/idle_fraction" in m]
    assert all(0 <= x <= 1 for x in idle) and (idle or not in_flight)
    assert all(m["weight_sync/direct_mib"] > 0 for m in steps)  # learner -> engines directly (gloo)
    assert not any(ev.kind == pb.EVENT_KIND_DROPPED and "stale" in ev.message for ev in events)


def test_cancel_stops_a_run_and_the_services_stay_usable(client):
    """CancelRun answers CANCELLING; the run then ends CANCELLED with what was in flight dropped as
    `cancelled` (the producer runs a step ahead, so something is)."""
    run = client.submit(spec(grpo__max_num_steps=200, grpo__val_period=0, checkpointing__enabled=False,
                             grpo__async_grpo={"enabled": True, "max_trajectory_age_steps": 1}))
    wait_for(client, run.run_id, pb.EVENT_KIND_STEP)
    assert client.cancel(run.run_id).state in (pb.RUN_STATE_CANCELLING, pb.RUN_STATE_CANCELLED)
    events = events_until_end(client, run.run_id, timeout_s=60)
    final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_CANCELLED and final.error.startswith("by CancelRun at step")
    states = [ev.message.split(":")[0] for ev in events if ev.kind == pb.EVENT_KIND_STATE]
    assert states[-2:] == ["cancelling", "cancelled"]
    assert final.ledger.dropped["cancelled"] > 0
    assert_records_agree(final, events)
    assert client.cancel(run.run_id).state == pb.RUN_STATE_CANCELLED  # cancelling again changes nothing
    again = client.submit(spec(grpo__max_num_steps=1, grpo__val_period=0))
    events_until_end(client, again.run_id)
    assert client.get(again.run_id).state == pb.RUN_STATE_SUCCEEDED


@pytest.mark.parametrize("text, code, field", [
    (spec(grpo__num_prompts_per_stpe=3), grpc.StatusCode.INVALID_ARGUMENT, "grpo.num_prompts_per_stpe"),
    (spec(policy__model_name="no-such-model"), grpc.StatusCode.INVALID_ARGUMENT, "policy.model_name"),
    (spec(policy__model_name="/no/such/model"), grpc.StatusCode.PERMISSION_DENIED, "policy.model_name"),
    (spec(policy__max_total_sequence_length=200), grpc.StatusCode.FAILED_PRECONDITION,
     "policy.max_total_sequence_length"),
    (spec(reward__functions=[{"name": "x", "import_path": "no_such_mod:f"}]), grpc.StatusCode.PERMISSION_DENIED,
     "reward.functions.0.import_path"),
    ("[1, 2", grpc.StatusCode.INVALID_ARGUMENT, "spec_yaml"),
    # The engine is deployed with the cluster: a run may state it, not change it.
    (spec(policy__generation__backend="transformers"), grpc.StatusCode.FAILED_PRECONDITION,
     "policy.generation.backend: the run asks for 'transformers' but the rollout service runs 'vllm'"),
    (spec(policy__generation__vllm_cfg__max_model_len=1024), grpc.StatusCode.FAILED_PRECONDITION,
     "policy.generation.vllm_cfg.max_model_len: the run asks for 1024 but the rollout service runs 128"),
    (spec(checkpointing__checkpoint_dir="/tmp/elsewhere"), grpc.StatusCode.INVALID_ARGUMENT,
     "checkpointing.checkpoint_dir: not supported"),
    (spec(policy__routing_replay=True), grpc.StatusCode.INVALID_ARGUMENT,
     "policy.routing_replay: replays Mixtral- and Qwen3-MoE-shaped models' routing; "),
    # tiny has 2 KV heads: the dtensor plan cannot split them 4 ways.
    (spec(policy__dtensor_cfg__tensor_parallel_size=4, cluster__num_workers=4), grpc.StatusCode.FAILED_PRECONDITION,
     "policy.dtensor_cfg.tensor_parallel_size 4 exceeds the model's 2 KV heads"),
])
def test_bad_specs_are_refused_naming_the_field(client, text, code, field):
    with pytest.raises(grpc.RpcError) as err:
        client.submit(text)
    assert err.value.code() == code
    assert field in err.value.details()


def test_megatron_refuses_an_architecture_it_cannot_reproduce_at_submit(client, test_cluster):
    from tests.support.architectures import make_architecture

    gemma = make_architecture("gemma2", test_cluster.models_dir / "gemma2")
    with pytest.raises(grpc.RpcError) as err:
        client.submit(spec(policy__model_name=str(gemma), policy__megatron_cfg={"enabled": True}))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "policy.megatron_cfg" in err.value.details() and "policy.dtensor_cfg" in err.value.details()


def test_a_run_that_cannot_work_fails_in_its_preflight(client):
    """A model of another architecture than the rollout serves: SubmitRun queues it at once (no model is
    built in the request handler), the preflight fails it naming the field, and the next run still runs."""
    run = client.submit(spec(policy__model_name="preset:small"))
    assert run.state == pb.RUN_STATE_QUEUED
    events = events_until_end(client, run.run_id)
    final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_FAILED and final.step == 0
    assert final.error.startswith("preflight:") and "policy.model_name" in final.error
    assert any(ev.kind == pb.EVENT_KIND_ERROR for ev in events)
    assert not any(ev.kind == pb.EVENT_KIND_STEP for ev in events)


def test_unknown_runs_are_not_found(client):
    with pytest.raises(grpc.RpcError) as err:
        client.get("no-such-run")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def start_reward_server(**popen_kwargs) -> tuple[subprocess.Popen, int]:
    """The standalone reward server (scripts/reward_server.py) on a free loopback port, once it accepts."""
    port = free_port()
    server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "reward_server.py"), "--port", str(port)],
                              **popen_kwargs)
    deadline = time.time() + 60
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        if time.time() > deadline or server.poll() is not None:
            server.kill()
            raise AssertionError("reward server did not start")
        time.sleep(0.3)
    return server, port


def test_an_external_reward_server_replaces_the_reward_service(client):
    server, port = start_reward_server(stderr=subprocess.PIPE, text=True)
    try:
        # The spec's functions (partial-credit exact match) travel with each request, so the steps have a
        # reward signal to train on (a run that trains nothing fails).
        run = client.submit(spec(reward__endpoint=f"127.0.0.1:{port}", grpo__max_num_steps=2))
        events_until_end(client, run.run_id)
        final = client.get(run.run_id)
        assert final.state == pb.RUN_STATE_SUCCEEDED, final.error
    finally:
        server.terminate()
        log = server.communicate(timeout=30)[1]
    assert "event=reward_server.scored" in log


def test_cli_submit_watch_and_runs(test_cluster, tmp_path):
    cli = str(Path(sys.executable).with_name("rlserve"))
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(spec(grpo__max_num_steps=2, grpo__val_period=1))
    out = subprocess.run([cli, "submit", str(spec_file), "--watch", "--run-id", "itest-cli", "--endpoint",
                          test_cluster.endpoint], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "succeeded" in out.stdout and "held-out reward: before" in out.stdout.splitlines()[-1]
    listed = subprocess.run([cli, "runs", "list", "--endpoint", test_cluster.endpoint], capture_output=True,
                            text=True)
    assert "itest-cli" in listed.stdout
    spent = subprocess.run([cli, "runs", "usage", "--endpoint", test_cluster.endpoint], capture_output=True,
                           text=True)
    assert spent.returncode == 0 and "itest-cli" in spent.stdout and "total of " in spent.stdout, spent.stderr
    run_id = next(line.split()[0] for line in listed.stdout.splitlines() if "itest-cli" in line)
    got = subprocess.run([cli, "runs", "get", run_id, "--endpoint", test_cluster.endpoint], capture_output=True,
                         text=True)
    assert "consistency: median token_mult_prob_error 1.0000" in got.stdout, got.stdout
    missing = subprocess.run([cli, "runs", "get", "nope", "--endpoint", test_cluster.endpoint], capture_output=True,
                             text=True)
    assert missing.returncode == 2 and "NOT_FOUND" in missing.stderr


def test_sft_warm_start_then_grpo(client):
    run = client.submit(spec(sft={"enabled": True, "max_num_steps": 4, "val_period": 2, "batch_size": 16,
                                  "stop_at_val_reward": None}, grpo__max_num_steps=2))
    events = events_until_end(client, run.run_id)
    run = client.get(run.run_id)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    assert any("SFT warm start done after 4 steps" in ev.message for ev in events)
    assert (Path(run.run_dir) / "sft_model" / "model.safetensors").is_file()


def test_a_service_that_stays_down_fails_the_run_with_retries_then_an_error(client):
    server, port = start_reward_server(stderr=subprocess.DEVNULL)
    try:
        run = client.submit(spec(reward__endpoint=f"127.0.0.1:{port}", reward__functions=None,
                                 grpo__max_num_steps=100, grpo__val_period=0, checkpointing__enabled=False))
        wait_for(client, run.run_id, pb.EVENT_KIND_STEP)
    finally:
        server.kill()
        server.wait()
    events = events_until_end(client, run.run_id)
    final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_FAILED
    assert "reward.Score still failing after 3 retries" in final.error and "UNAVAILABLE" in final.error
    retries = [ev for ev in events if ev.kind == pb.EVENT_KIND_RETRY]
    assert len(retries) == 3 and all("reward.Score" in ev.message for ev in retries)
    assert any(ev.kind == pb.EVENT_KIND_ERROR for ev in events)
    assert not any(ev.kind == pb.EVENT_KIND_RECOVERED for ev in events), "a service that is down is not lost state"
    assert_records_agree(final, events)  # what was in flight is dropped as `failed`
