"""Model-backed rewards: a generated sequence classifier and a generated chat judge (real transformers
models, real forward passes), the judge's score parsing, batching, and the allow-list of model folders."""

from __future__ import annotations

import grpc
import pytest
import torch

from rlserve.rewards.config import RewardFunctionCfg
from rlserve.rewards.interfaces import BatchRewardFunction, RewardInput, RewardOutput
from rlserve.rewards.judge import LlmJudge, parse_score
from rlserve.rewards.loader import CombinedReward
from rlserve.rewards.reward_model import SequenceClassifierReward
from rlserve.rewards.scoring import score_batch
from rlserve.rpc import RpcError
from rlserve.security.plugins import PluginPolicy
from rlserve.v1 import reward_pb2
from tests.support.reward_models import make_classifier

ITEMS = [RewardInput("12+34=", "64", "64"), RewardInput("5+5=", "01", "01"),
         RewardInput("99+1=", "0010000", "001"), RewardInput("7+", "", "")]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return make_classifier(tmp_path_factory.mktemp("rm") / "classifier")


@pytest.mark.parametrize("text, want", [
    ("7", 7.0), ("Score: 8.5", 8.5), ("7/10", 7.0), ("  10", 10.0), ("0", 0.0), ("I'd say 3 out of 10", 3.0),
    ("", None), ("no number here", None), ("11", None), ("-1", None), ("x7", None), ("1e400", 1.0),
    ("nan", None), ("inf", None), ("٣", None), ("9" * 5000, None)])
def test_judge_reads_the_first_number_in_range(text, want):
    assert parse_score(text, 0, 10) == want


def test_classifier_scores_batches_as_it_scores_items_alone(classifier):
    rm = SequenceClassifierReward(str(classifier), batch_size=3)
    batch = [o.score for o in rm.score_batch(ITEMS)]
    alone = [rm(i).score for i in ITEMS]
    assert batch == pytest.approx(alone, abs=1e-5)
    # Against the model's own forward pass on the unpadded text: the head reads the last real token.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(classifier)
    enc = tok("12+34=64", return_tensors="pt")
    with torch.no_grad():
        want = rm.model(**enc).logits[0, 0].item()
    assert batch[0] == pytest.approx(want, abs=1e-5)
    assert len(set(round(s, 6) for s in batch)) > 1  # different texts, different scores
    squashed = SequenceClassifierReward(str(classifier), sigmoid=True).score_batch(ITEMS)
    assert [o.score for o in squashed] == pytest.approx([torch.sigmoid(torch.tensor(s)).item() for s in batch],
                                                        abs=1e-6)


def test_classifier_of_several_labels_gives_a_probability(tmp_path):
    folder = make_classifier(tmp_path / "three", num_labels=3, seed=1)
    scores = [o.score for o in SequenceClassifierReward(str(folder), label=0).score_batch(ITEMS)]
    assert all(0.0 < s < 1.0 for s in scores)
    with pytest.raises(ValueError, match="label"):
        SequenceClassifierReward(str(folder), label=3)
    with pytest.raises(ValueError, match="sigmoid"):
        SequenceClassifierReward(str(folder), sigmoid=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "/nonexistent/folder"}, "no config.json"), ({"batch_size": 0}, "batch_size"),
    ({"max_length": True}, "max_length"), ({"template": "{prompt.__class__}"}, "template"),
    ({"template": "{completion!r}"}, "template")])
def test_classifier_refuses_bad_args(classifier, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SequenceClassifierReward(**{"model": str(classifier), **kwargs})


def test_a_malformed_judge_answer_scores_zero_with_a_metric():
    # The generated chat model answers noise; no number of it lies in [1000, 2000], so every answer is unparsed.
    judge = LlmJudge("preset:tiny-chat", min_score=1000, max_score=2000, max_new_tokens=6, batch_size=3)
    outs = judge.score_batch(ITEMS)
    assert len(outs) == len(ITEMS)
    assert all(o.score == 0.0 and o.metrics == {"unparsed": 1.0} for o in outs)
    # Through the service's scoring: OK items, a component and the metric, never an error.
    resp = score_batch(CombinedReward([RewardFunctionCfg(name="llm_judge", args={
        "model": "preset:tiny-chat", "min_score": 1000, "max_score": 2000, "max_new_tokens": 6})]),
        reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id=str(i), prompt=x.prompt, completion=x.completion)
                                       for i, x in enumerate(ITEMS)]))
    assert resp.num_errors == 0
    assert all(r.status == reward_pb2.SCORE_STATUS_OK and r.metrics["llm_judge/unparsed"] == 1.0 for r in resp.results)


def test_judge_scales_a_parsed_score_to_zero_one():
    judge = LlmJudge("preset:tiny-chat", min_score=0, max_score=10, max_new_tokens=6)
    for out in judge.score_batch(ITEMS[:2]):
        value = parse_score(out.info["answer"], 0, 10)
        assert out.score == (0.0 if value is None else value / 10)
        assert out.metrics == {"unparsed": float(value is None)}


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "preset:tiny"}, "chat template"), ({"min_score": 5, "max_score": 5}, "max_score"),
    ({"rubric": "{prompt} {secret}"}, "rubric"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"min_score": float("nan")}, "min_score")])
def test_judge_refuses_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlmJudge(**{"model": "preset:tiny-chat", **kwargs})


class _Broken(BatchRewardFunction):
    def score_batch(self, items):
        raise RuntimeError("the model ran out of memory")


class _Counted(BatchRewardFunction):
    def score_batch(self, items):
        return [RewardOutput(float(len(i.completion)), metrics={"chars": float(len(i.completion))}) for i in items]


def test_a_failing_batch_function_fails_its_items_not_the_batch(monkeypatch):
    reward = CombinedReward([RewardFunctionCfg(name="exact_match")])
    monkeypatch.setattr(reward, "functions", [_Broken()])
    outs = reward.score_many(ITEMS)
    assert all(isinstance(o, RuntimeError) for o in outs)
    monkeypatch.setattr(reward, "functions", [_Counted()])
    outs = reward.score_many(ITEMS)
    assert [o.total for o in outs] == [2.0, 2.0, 7.0, 0.0]
    assert outs[2].metrics == {"exact_match/chars": 7.0}


def test_model_folders_must_be_allow_listed(tmp_path):
    allowed = tmp_path / "reward_models"
    policy = PluginPolicy([], [str(allowed)])
    for model in (str(allowed), str(allowed / "classifier"), "preset:tiny-chat"):
        policy.check_function("f", RewardFunctionCfg(name="reward_model", args={"model": model}))
    for model in (str(tmp_path / "elsewhere"), str(allowed / ".." / "elsewhere"), None, 3, "\x00"):
        with pytest.raises(RpcError) as err:
            policy.check_function("spec_yaml: reward.functions.0",
                                  RewardFunctionCfg(name="llm_judge", args={"model": model}))
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.message.startswith("spec_yaml: reward.functions.0.args.model:")
        assert "reward.allowed_models" in err.value.message
    # Other built-ins take no model; plug-ins by import path are checked as before.
    policy.check_function("f", RewardFunctionCfg(name="exact_match"))
    with pytest.raises(RpcError, match="allowed_plugins"):
        policy.check_function("f", RewardFunctionCfg(name="x", import_path="os:system"))
