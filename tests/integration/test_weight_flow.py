"""Weights: in-place updates land exactly, bad updates are rejected with the old weights still
serving, every rollout replica (also a restarted one) serves the newest publication, and the
learner's exported weights reproduce the learner's logprobs in the rollout service."""

from __future__ import annotations

import time

import grpc
import pytest
import ray
from ray import serve

from rlserve.models import resolve_model
from rlserve.models.factory import make_model
from rlserve.models.presets import get_preset
from rlserve.v1 import common_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.integration.rollout_support import max_error

PROMPTS = [[8, 11, 41, 12, 9, 47], [5, 6, 42, 7]]
_version = iter(range(20_000, 30_000))


def generate(stub, n=4, temperature=1.0, seed=3) -> rollout_pb2.GenerateResponse:
    return stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=p)) for p in PROMPTS], num_samples=n,
        sampling=common_pb2.SamplingParams(temperature=temperature, max_new_tokens=8, seed=seed)), timeout=120)


def load(stub, path, version=None) -> rollout_pb2.UpdateWeightsResponse:
    return stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(
        version=version or next(_version), safetensors_path=str(path), force=True), timeout=120)


def replicas_versions(stub, calls=12) -> dict[str, int]:
    seen = {}
    for _ in range(calls):
        info = stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=60)
        seen[info.replica_id] = info.weight_version
    return seen


def settle(stub, version: int, timeout_s: float = 60) -> dict[str, int]:
    """Both replicas serve `version` (the one called loads it at once, the other on the fleet's announcement)."""
    deadline = time.time() + timeout_s
    while True:
        versions = replicas_versions(stub)
        if len(versions) == 2 and set(versions.values()) == {version}:
            return versions
        assert time.time() < deadline, f"replicas did not all move to version {version}: {versions}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def second_model(test_cluster):
    return make_model(get_preset("tiny"), test_cluster.models_dir / "second", seed=7)


def test_update_to_a_second_model_matches_transformers_on_every_replica(channel, second_model):
    stub = rollout_pb2_grpc.RolloutStub(channel)
    applied = load(stub, second_model)
    settle(stub, applied.weight_version)
    resp = generate(stub)
    assert resp.weight_version == applied.weight_version
    assert max_error(resp, second_model) < 1e-4
    assert max_error(resp, resolve_model("preset:tiny")) > 1e-2


def test_bad_updates_are_rejected_and_old_weights_keep_serving(channel, test_cluster):
    stub = rollout_pb2_grpc.RolloutStub(channel)
    settle(stub, load(stub, resolve_model("preset:tiny")).weight_version)
    before = generate(stub, n=1, temperature=0.0)
    wrong_shapes = make_model(get_preset("small"), test_cluster.models_dir / "small")
    with pytest.raises(grpc.RpcError) as err:
        load(stub, wrong_shapes)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("safetensors_path:") and "shape" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        load(stub, test_cluster.models_dir / "nowhere")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = generate(stub, n=1, temperature=0.0)
    assert after.completions == before.completions
    assert after.weight_version == before.weight_version


def test_a_restarted_replica_loads_the_newest_publication(channel, second_model, ray_driver):
    stub = rollout_pb2_grpc.RolloutStub(channel)
    version = load(stub, second_model).weight_version
    victim = next(iter(settle(stub, version)))
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["namespace"] == "serve" and "rollout" in a["name"] and victim in a["name"]]
    assert actors, "could not find the replica actor"
    ray.kill(ray.get_actor(actors[0]["name"], namespace="serve"), no_restart=True)
    deadline = time.time() + 240
    while True:
        status = serve.status().applications["rollout"]
        versions = replicas_versions(stub) if status.status == "RUNNING" else {}
        if len(versions) == 2 and victim not in versions:
            break
        assert time.time() < deadline, f"rollout did not recover: {status}"
        time.sleep(2)
    assert set(versions.values()) == {version}


def test_learner_export_reproduces_learner_logprobs(channel, test_cluster):
    learner = learner_pb2_grpc.LearnerStub(channel)
    spec = "policy: {max_total_sequence_length: 64, generation: {max_new_tokens: 8}}"
    info = learner.Configure(learner_pb2.ConfigureRequest(run_id="weights-test", spec_yaml=spec))
    assert info.backend == "dtensor" and info.num_parameters > 0
    batch = [learner_pb2.TrainSequence(token_ids=[8, 11, 41, 12, 9, 47, 6, 7, 5, 2], prompt_length=6)] * 8
    for version in range(3):
        out = learner.TrainStep(learner_pb2.TrainStepRequest(run_id="weights-test", loss_name="sft",
                                                             sequences=batch, learning_rate=1e-2,
                                                             expected_weight_version=version))
        assert out.weight_version == version + 1 and out.metrics["loss/total"] > 0
    exported = learner.ExportWeights(learner_pb2.ExportWeightsRequest(run_id="weights-test"))
    assert exported.weight_version == 3 and exported.num_tensors == 21
    # Checkpoints and exports go inside the runs directory (relative paths are taken from there).
    hf = test_cluster.runs_dir / "weights-test" / "learner_hf"
    learner.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(run_id="weights-test", path="weights-test/ckpt",
                                                             hf_path=str(hf)))
    stub = rollout_pb2_grpc.RolloutStub(channel)
    stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=3, store_name="rlserve-weights"))
    settle(stub, 3)
    resp = generate(stub)
    assert resp.weight_version == 3
    assert max_error(resp, hf) < 1e-4
    assert max_error(resp, resolve_model("preset:tiny")) > 1e-3
