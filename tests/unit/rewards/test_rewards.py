"""Reward plug-ins: built-ins, loading by import path or file, and failure isolation per item."""

from __future__ import annotations

import json

import pytest

from rlserve.rewards.builtins import LengthPenalty, MathVerify, extract_answer
from rlserve.rewards.interfaces import RewardInput
from rlserve.rewards.loader import CombinedReward, FunctionSpec
from rlserve.rewards.scoring import score_batch
from rlserve.v1 import reward_pb2


def item(completion: str, answer: str = "42") -> RewardInput:
    return RewardInput("q", completion, answer)


@pytest.mark.parametrize("text, want", [
    ("so the answer is \\boxed{42}", 1.0), ("the answer is 42.", 1.0), ("1,000 apples", 0.0),
    ("it is 41 or 42", 1.0), ("no number", 0.0), ("\\boxed{84/2}", 1.0)])
def test_math_verify(text, want):
    assert MathVerify()(item(text)).score == want


def test_extract_answer_prefers_boxed():
    assert extract_answer("7 then \\boxed{3} then 9") == "3"


def test_length_penalty_caps():
    assert LengthPenalty(max_chars=2, per_char=0.5, cap=1.0)(item("abcdef")).score == -1.0


def test_combined_weights_and_plugin_file(tmp_path):
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def reward(item):\n    return float(len(item.completion))\n"
                      "class Scaled:\n    def __init__(self, k):\n        self.k = k\n"
                      "    def __call__(self, item):\n        return self.k\n")
    reward = CombinedReward([FunctionSpec.make("len", f"{plugin}"), FunctionSpec.make("exact_match", weight=2.0),
                             FunctionSpec.make("k", f"{plugin}:Scaled", 0.5, {"k": 4})])
    score, components, _ = reward(item("42"))
    assert components == {"len": 2.0, "exact_match": 1.0, "k": 4.0}
    assert score == 2.0 + 2.0 + 2.0


def test_bad_specs_are_errors():
    with pytest.raises(ValueError, match="unknown reward function"):
        CombinedReward([FunctionSpec.make("nope")])
    with pytest.raises(ValueError, match="cannot import"):
        CombinedReward([FunctionSpec.make("x", "no_such_module_xyz:f")])


def test_a_failing_item_does_not_fail_the_batch(tmp_path):
    plugin = tmp_path / "flaky.py"
    plugin.write_text("import math\n"
                      "def reward(item):\n"
                      "    if item.completion == 'boom':\n        raise RuntimeError('plug-in bug')\n"
                      "    if item.completion == 'nan':\n        return math.nan\n"
                      "    return 1.0\n")
    reward = CombinedReward([FunctionSpec.make("flaky", str(plugin))])
    req = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id=str(i), completion=c, metadata_json=json.dumps({}))
                                         for i, c in enumerate(["ok", "boom", "nan", "ok"])])
    resp = score_batch(reward, req)
    assert [r.status for r in resp.results] == [reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_ERROR,
                                                reward_pb2.SCORE_STATUS_ERROR, reward_pb2.SCORE_STATUS_OK]
    assert resp.num_errors == 2 and "plug-in bug" in resp.results[1].error and "non-finite" in resp.results[2].error


def test_weight_zero_is_honoured_and_unset_means_one():
    """The proto field is optional: 0 arrives as 0 (reported, adds nothing), unset as 1."""
    from rlserve.rewards.scoring import specs_from_proto

    specs = specs_from_proto([reward_pb2.RewardFunctionSpec(name="exact_match", weight=0.0),
                              reward_pb2.RewardFunctionSpec(name="format")])
    assert [s.weight for s in specs] == [0.0, 1.0]
    score, components, _ = CombinedReward(specs[:1])(item("42"))
    assert score == 0.0 and components == {"exact_match": 1.0}
