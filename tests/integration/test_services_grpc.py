"""Rollout, reward, reference and learner through the gateway with a plain grpcio client (the test
cluster exposes them to its admin token), and through DeploymentHandles with the same messages; bad
requests get a status naming the field and the services stay up."""

from __future__ import annotations

import json

import grpc
import pytest
from ray import serve

from rlserve.rpc import RpcError
from rlserve.v1 import (
    common_pb2,
    learner_pb2,
    learner_pb2_grpc,
    reference_pb2,
    reference_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)

PROMPT = [8, 11, 41, 12, 9, 47]


def gen_request(prompts=(PROMPT,), n=2, **sampling) -> rollout_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=6, **sampling)
    return rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=list(p))) for p in prompts], num_samples=n,
        sampling=params)


def status_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_rollout_over_grpc(channel):
    stub = rollout_pb2_grpc.RolloutStub(channel)
    info = stub.GetInfo(rollout_pb2.GetInfoRequest())
    assert info.engine == "vllm" and info.max_model_len == 128 and info.architecture_fingerprint
    resp = stub.Generate(gen_request(n=3, seed=1))
    (completion,) = resp.completions
    assert list(completion.prompt_token_ids) == PROMPT and len(completion.samples) == 3
    for s in completion.samples:
        assert len(s.token_ids) == len(s.logprobs) > 0
        assert s.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    text = stub.Generate(rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="47+85=")], num_samples=1,
                                                     sampling=common_pb2.SamplingParams(max_new_tokens=4)))
    assert list(text.completions[0].prompt_token_ids) == PROMPT
    # vLLM's model runs in a layout of its own (fused projections): it cannot say what it serves by
    # checkpoint name, and says so (the transformers engine can: tests/engines, tests/gpu).
    err = status_of(lambda: stub.GetInfo(rollout_pb2.GetInfoRequest(weight_digests=True)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and err.details().startswith("weight_digests:")


@pytest.mark.parametrize("request_, field", [
    (rollout_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_new_tokens=4)), "prompts"),
    (gen_request(prompts=([],)), "prompts[0]"),
    (gen_request(prompts=(list(range(4, 60)) * 3,)), "prompts[0]"),
    (gen_request(prompts=([999],)), "prompts[0].token_ids"),
    (gen_request(top_p=2.0), "sampling.top_p"),
    (rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="1+1=")]), "sampling.max_new_tokens"),
    (rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="1+1=")], priority=-1,
                                 sampling=common_pb2.SamplingParams(max_new_tokens=4)), "priority"),
    (rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="1+1=")], priority=101,
                                 sampling=common_pb2.SamplingParams(max_new_tokens=4)), "priority"),
    (rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="1+1=")], shared_base=True,
                                 sampling=common_pb2.SamplingParams(max_new_tokens=4)), "run_id"),
])
def test_rollout_rejects_bad_requests(channel, request_, field):
    stub = rollout_pb2_grpc.RolloutStub(channel)
    err = status_of(lambda: stub.Generate(request_))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field + ":")
    assert stub.GetInfo(rollout_pb2.GetInfoRequest()).engine == "vllm"


def test_a_rollout_that_cannot_record_routing_says_why(channel):
    """vLLM's CPU backend has no routed-experts capture: GetInfo says so, and a request for routing is
    refused FAILED_PRECONDITION with that reason (SubmitRun refuses policy.routing_replay for it)."""
    stub = rollout_pb2_grpc.RolloutStub(channel)
    reason = stub.GetInfo(rollout_pb2.GetInfoRequest()).routing_unavailable
    assert "Model Runner V2" in reason
    request_ = gen_request()
    request_.routed_experts = True
    err = status_of(lambda: stub.Generate(request_))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == f"routed_experts: the vllm engine cannot record MoE routing ({reason})"


@pytest.mark.parametrize("request_, field", [
    (rollout_pb2.UpdateWeightsRequest(shared_base=True, store_name="rlserve-weights"), "run_id"),
    (rollout_pb2.UpdateWeightsRequest(shared_base=True, run_id="alice.r", store_name="other"), "store_name"),
    (rollout_pb2.UpdateWeightsRequest(shared_base=True, run_id="alice.r", safetensors_path="/tmp"), "store_name"),
])
def test_rollout_rejects_bad_run_adapter_updates(channel, request_, field):
    stub = rollout_pb2_grpc.RolloutStub(channel)
    err = status_of(lambda: stub.UpdateWeights(request_))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field + ":")
    assert stub.GetInfo(rollout_pb2.GetInfoRequest()).lora_enabled


def test_rollout_through_a_handle(ray_driver):
    handle = serve.get_app_handle("rollout")
    resp = handle.Generate.remote(gen_request(n=2, seed=4)).result()
    assert len(resp.completions[0].samples) == 2 and resp.replica_id
    with pytest.raises(RpcError) as err:
        handle.Generate.remote(gen_request(prompts=([],))).result()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_reward_over_grpc_isolates_failing_items(channel, test_cluster):
    stub = reward_pb2_grpc.RewardStub(channel)
    items = [reward_pb2.ScoreItem(id="a", completion="231", reference_answer="231"),
             reward_pb2.ScoreItem(id="b", completion="9", reference_answer="231")]
    resp = stub.Score(reward_pb2.ScoreRequest(items=items))
    assert [r.score for r in resp.results] == [1.0, 0.0] and resp.reward_version
    # The allow-listed plug-in file raises for one item: that item is an error, the batch is scored.
    resp = stub.Score(reward_pb2.ScoreRequest(items=items, functions=[
        reward_pb2.RewardFunctionSpec(name="plug", import_path=test_cluster.plugin)]))
    assert [r.status for r in resp.results] == [reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_ERROR]
    assert resp.num_errors == 1 and "oops" in resp.results[1].error
    err = status_of(lambda: stub.Score(reward_pb2.ScoreRequest(items=items, functions=[
        reward_pb2.RewardFunctionSpec(name="x", import_path="no_such_module:f")])))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.details().startswith("functions[0].import_path:") and "reward.allowed_plugins" in err.details()
    err = status_of(lambda: stub.Score(reward_pb2.ScoreRequest(items=items, functions=[
        reward_pb2.RewardFunctionSpec(name="nope")])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("functions:")
    err = status_of(lambda: stub.Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(metadata_json="{")])))
    assert err.details().startswith("items[0].metadata_json:")


def test_reward_app_serves_a_reward_model_and_a_judge(channel, test_cluster):
    """A generated classifier (in an allow-listed folder) and a generated chat judge, batched in the reward
    replica; the judge's unparsable answers score 0 with a metric; a folder off the list is refused."""
    from tests.support.reward_models import make_classifier

    folder = make_classifier(test_cluster.models_dir / "reward" / "classifier")
    stub = reward_pb2_grpc.RewardStub(channel)
    items = [reward_pb2.ScoreItem(id=str(i), prompt="12+34=", completion=c) for i, c in enumerate(["64", "46", ""])]
    rm = reward_pb2.RewardFunctionSpec(name="reward_model", args_json=json.dumps({"model": str(folder)}))
    resp = stub.Score(reward_pb2.ScoreRequest(items=items, functions=[rm]), timeout=120)
    assert resp.num_errors == 0 and len({round(r.score, 6) for r in resp.results}) == 3
    assert [r.components["reward_model"] for r in resp.results] == [r.score for r in resp.results]
    judge = reward_pb2.RewardFunctionSpec(name="llm_judge", weight=0.5, args_json=json.dumps(
        {"model": "preset:tiny-chat", "min_score": 1000, "max_score": 2000, "max_new_tokens": 4}))
    resp = stub.Score(reward_pb2.ScoreRequest(items=items, functions=[rm, judge]), timeout=180)
    assert resp.num_errors == 0
    assert all(r.components["llm_judge"] == 0.0 and r.metrics["llm_judge/unparsed"] == 1.0 for r in resp.results)
    elsewhere = make_classifier(test_cluster.models_dir / "not_allowed")
    err = status_of(lambda: stub.Score(reward_pb2.ScoreRequest(items=items, functions=[
        reward_pb2.RewardFunctionSpec(name="reward_model", args_json=json.dumps({"model": str(elsewhere)}))])))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.details().startswith("functions[0].args.model:") and "reward.allowed_models" in err.details()
    assert stub.Score(reward_pb2.ScoreRequest(items=items[:1])).results[0].status == reward_pb2.SCORE_STATUS_OK


def test_reference_matches_rollout_logprobs(channel, test_cluster):
    """Reference logprobs equal the rollout's sampled-token logprobs for the same weights (1e-4)."""
    from rlserve.models import resolve_model

    model = resolve_model("preset:tiny")
    rollout = rollout_pb2_grpc.RolloutStub(channel)
    rollout.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=10_000, safetensors_path=str(model), force=True))
    resp = rollout.Generate(gen_request(prompts=(PROMPT, [5, 6, 42]), n=4, seed=2))
    seqs, lps = [], []
    for c in resp.completions:
        for s in c.samples:
            seqs.append(reference_pb2.ScoredSequence(token_ids=list(c.prompt_token_ids) + list(s.token_ids),
                                                     prompt_length=len(c.prompt_token_ids)))
            lps.append(list(s.logprobs))
    ref = reference_pb2_grpc.ReferenceStub(channel).LogProbs(
        reference_pb2.LogProbsRequest(sequences=seqs, model_path=str(model)))
    err = max(abs(a - b) for r, g in zip(ref.sequences, lps) for a, b in zip(r.logprobs, g))
    assert err < 1e-4
    bad = status_of(lambda: reference_pb2_grpc.ReferenceStub(channel).LogProbs(reference_pb2.LogProbsRequest(
        sequences=[reference_pb2.ScoredSequence(token_ids=[1, 2], prompt_length=2)])))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and bad.details().startswith("sequences[0].prompt_length:")


def test_learner_rejects_bad_specs_and_unknown_runs(channel):
    stub = learner_pb2_grpc.LearnerStub(channel)
    err = status_of(lambda: stub.Configure(learner_pb2.ConfigureRequest(
        run_id="x", spec_yaml="grpo: {num_prompts_per_stpe: 3}")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "grpo.num_prompts_per_stpe" in err.details()
    err = status_of(lambda: stub.TrainStep(learner_pb2.TrainStepRequest(
        run_id="nobody", loss_name="sft",
        sequences=[learner_pb2.TrainSequence(token_ids=[1, 2, 3], prompt_length=1)])))
    assert err.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND)
    err = status_of(lambda: stub.TrainStep(learner_pb2.TrainStepRequest(run_id="x", loss_name="ppo")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("loss_name:")
    assert "valid: grpo, cispo, sft, dpo" in err.details()


def test_score_metadata_is_passed_to_plugins(channel):
    stub = reward_pb2_grpc.RewardStub(channel)
    item = reward_pb2.ScoreItem(completion="3*5+7", metadata_json=json.dumps({"numbers": [3, 5, 7], "target": 22}))
    resp = stub.Score(reward_pb2.ScoreRequest(items=[item], functions=[reward_pb2.RewardFunctionSpec(
        name="countdown")]))
    assert resp.results[0].score == 1.0


def test_math_verify_scores_in_the_reward_service(channel):
    """The math-verify checks run in the replica's helper process (its time limits need a main thread)."""
    stub = reward_pb2_grpc.RewardStub(channel)
    items = [reward_pb2.ScoreItem(id="a", completion="so $\\frac{2}{4}$", reference_answer="\\frac{1}{2}"),
             reward_pb2.ScoreItem(id="b", completion="it is 0.4", reference_answer="\\frac{1}{2}")]
    resp = stub.Score(reward_pb2.ScoreRequest(items=items, functions=[reward_pb2.RewardFunctionSpec(
        name="math_verify")]))
    assert [r.score for r in resp.results] == [1.0, 0.0] and resp.num_errors == 0
