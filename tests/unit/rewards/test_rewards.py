"""Reward plug-ins: built-ins, loading by import path or file, and failure isolation per item."""

from __future__ import annotations

import json

import pytest

from rlserve.rewards.builtins import LengthPenalty
from rlserve.rewards.config import RewardFunctionCfg
from rlserve.rewards.interfaces import RewardInput
from rlserve.rewards.loader import CombinedReward
from rlserve.rewards.math_answers import MathVerify
from rlserve.rewards.scoring import score_batch
from rlserve.v1 import reward_pb2


def item(completion: str, answer: str = "42") -> RewardInput:
    return RewardInput("q", completion, answer)


@pytest.mark.parametrize("answer, text, want", [
    ("42", "so the answer is \\boxed{42}", 1.0), ("42", "the answer is 42.", 1.0), ("42", "1,000 apples", 0.0),
    ("42", "it is 41 or 42", 1.0), ("42", "no number", 0.0), ("42", "\\boxed{84/2}", 1.0),
    ("42", "7 then \\boxed{3} then 42", 0.0),  # a boxed answer wins over a later number
    ("\\frac{1}{2}", "the answer is $\\frac12$", 1.0), ("\\frac{1}{2}", "it is 0.5", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
    ("\\{1,2\\}", "The set is $\\{2,1\\}$", 1.0), ("\\{1,2\\}", "The set is $\\{1,3\\}$", 0.0),
    ("5\\text{ cm}", "\\boxed{5}", 1.0), ("10\\%", "\\boxed{10}", 1.0),
    ("\\frac{\\sqrt{2}}{2}", "$\\sqrt{2}/2$", 1.0), ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),
    ("She sold 48/2 = 24 clips in May.\n#### 72", "In all 72 clips.", 1.0),  # a GSM8K solution
    ("1,000", "1000", 1.0)])
def test_math_verify_checks_answers_like_the_math_verify_package(answer, text, want):
    out = MathVerify()(item(text, answer))
    assert out.score == want, out.info


def test_length_penalty_caps():
    assert LengthPenalty(max_chars=2, per_char=0.5, cap=1.0)(item("abcdef")).score == -1.0


def test_combined_weights_and_plugin_file(tmp_path):
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def reward(item):\n    return float(len(item.completion))\n"
                      "class Scaled:\n    def __init__(self, k):\n        self.k = k\n"
                      "    def __call__(self, item):\n        return self.k\n")
    reward = CombinedReward([RewardFunctionCfg(name="len", import_path=f"{plugin}"),
                             RewardFunctionCfg(name="exact_match", weight=2.0),
                             RewardFunctionCfg(name="k", import_path=f"{plugin}:Scaled", weight=0.5, args={"k": 4})])
    score, components, _, _ = reward(item("42"))
    assert components == {"len": 2.0, "exact_match": 1.0, "k": 4.0}
    assert score == 2.0 + 2.0 + 2.0


def test_bad_specs_are_errors():
    with pytest.raises(ValueError, match="unknown reward function"):
        CombinedReward([RewardFunctionCfg(name="nope")])
    with pytest.raises(ValueError, match="cannot import"):
        CombinedReward([RewardFunctionCfg(name="x", import_path="no_such_module_xyz:f")])


def test_a_failing_item_does_not_fail_the_batch(tmp_path):
    plugin = tmp_path / "flaky.py"
    plugin.write_text("import math\n"
                      "def reward(item):\n"
                      "    if item.completion == 'boom':\n        raise RuntimeError('plug-in bug')\n"
                      "    if item.completion == 'nan':\n        return math.nan\n"
                      "    return 1.0\n")
    reward = CombinedReward([RewardFunctionCfg(name="flaky", import_path=str(plugin))])
    req = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id=str(i), completion=c, metadata_json=json.dumps({}))
                                         for i, c in enumerate(["ok", "boom", "nan", "ok"])])
    resp = score_batch(reward, req)
    assert [r.status for r in resp.results] == [reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_ERROR,
                                                reward_pb2.SCORE_STATUS_ERROR, reward_pb2.SCORE_STATUS_OK]
    assert resp.num_errors == 2 and "plug-in bug" in resp.results[1].error and "non-finite" in resp.results[2].error


def test_a_math_check_past_its_time_limit_scores_zero_and_the_next_one_works():
    assert MathVerify()(item("\\boxed{42}")).score == 1.0  # the helper process is up
    huge = "\\boxed{" + "+".join(f"x_{{{i}}}^{{{i}}}" for i in range(400)) + "}"
    slow = MathVerify(timeout_s=0.01)(item(huge, "x"))
    assert slow.score == 0.0 and slow.info["timeout"]
    assert MathVerify()(item("\\boxed{42}")).score == 1.0


def test_weight_zero_is_honoured_and_unset_means_one():
    """The proto field is optional: 0 arrives as 0 (reported, adds nothing), unset as 1."""
    from rlserve.rewards.scoring import functions_from_proto
    from rlserve.security.plugins import PluginPolicy

    specs = functions_from_proto([reward_pb2.RewardFunctionSpec(name="exact_match", weight=0.0),
                              reward_pb2.RewardFunctionSpec(name="format")], PluginPolicy([]))
    assert [s.weight for s in specs] == [0.0, 1.0]
    score, components, _, _ = CombinedReward(specs[:1])(item("42"))
    assert score == 0.0 and components == {"exact_match": 1.0}
