"""Synthetic tasks and data sets: seeded, verifiable, split without leakage."""

from __future__ import annotations

import json
import random

import pytest

from rlserve.catalog import TASKS
from rlserve.config.spec import DataCfg
from rlserve.data.dataset import PromptSampler, build_splits
from rlserve.data.files import load_examples
from rlserve.data.tasks import get_task
from rlserve.environments.config import EnvironmentCfg
from rlserve.environments.interfaces import Episode, StepInput
from rlserve.environments.loader import load_environment
from rlserve.models.tokenizer import ALPHABET
from rlserve.rewards.builtins import Countdown, ExactMatch
from rlserve.rewards.interfaces import RewardInput
from rlserve.rewards.loader import CombinedReward


@pytest.mark.parametrize("name", TASKS.names)
def test_tasks_are_seeded_and_use_the_alphabet(name):
    task = get_task(name, {})
    a = [task.example(random.Random(7)) for _ in range(20)]
    b = [task.example(random.Random(7)) for _ in range(20)]
    assert a == b
    for ex in a:
        assert set(ex.prompt + ex.answer) <= set(ALPHABET), ex


def test_addition_answer_is_reversed_and_padded():
    ex = get_task("addition", {"digits": 2}).example(random.Random(0))
    a, b = ex.metadata["a"], ex.metadata["b"]
    assert ex.prompt == f"{a}+{b}="
    assert ex.answer == str(a + b).zfill(3)[::-1]
    assert ExactMatch()(RewardInput(ex.prompt, ex.answer, ex.answer)).score == 1.0


def test_countdown_answers_verify():
    task = get_task("countdown", {"num_numbers": 3})
    rng = random.Random(3)
    for _ in range(50):
        ex = task.example(rng)
        assert Countdown()(RewardInput(ex.prompt, ex.answer, ex.answer, ex.metadata)).score == 1.0


def play(env_name: str, env_args: dict, ex) -> list:
    """The task's demonstration played against the real environment: each observation it hears."""
    env = load_environment(EnvironmentCfg(name=env_name, args=env_args), default_reward=lambda: CombinedReward([]))
    episode = Episode("0", ex.prompt, ({"role": "user", "content": ex.prompt},), ex.answer, ex.metadata, ex.env_args)
    start = env.reset(episode)
    conversation, state, outs = list(start.messages), start.state, []
    turns = [m for m in ex.demonstration if m["role"] == "assistant"]
    for turn, said in enumerate(turns, start=1):
        out = env.step(StepInput(episode, conversation, said["content"], state, turn))
        conversation += [said, *out.observation]
        state = out.state
        outs.append(out)
    return outs


def test_guess_number_demonstrations_use_the_feedback_and_end_on_the_target():
    task = get_task("guess_number", {"max_number": 8})
    rng = random.Random(0)
    for _ in range(50):
        ex = task.example(rng)
        outs = play("guess_number", {"max_number": 8}, ex)
        heard = [m for m in ex.demonstration if m["role"] == "user"]
        assert [o.observation for o in outs[:-1]] == [[m] for m in heard]
        assert outs[-1].done and outs[-1].metrics["success"] == 1.0 and outs[-1].metrics["ignored_feedback"] == 0
        assert ex.demonstration[-1]["content"] == ex.answer
    # The demonstrator has a stream of its own: the games are those the data's stream drew before.
    rng, plain = random.Random(1), random.Random(1)
    assert [task.example(rng).answer for _ in range(20)] == [str(plain.randint(1, 8)) for _ in range(20)]


def test_tool_multiplication_demonstrates_the_calculator_and_without_the_tool_only_answers():
    ex = get_task("tool_multiplication", {}).example(random.Random(0))
    a, b = ex.metadata["a"], ex.metadata["b"]
    assert ex.prompt == f"{a}*{b}=" and ex.answer == str(a * b) and 100 <= a <= 999 and 10 <= b <= 99
    call, last = play("tool_use", {"functions": [{"name": "exact_match"}], "declare_tools": "none"}, ex)
    assert call.observation == [ex.demonstration[1]] and call.metrics["tool_calls"] == 1.0
    assert last.done and last.reward == 1.0
    assert get_task("tool_multiplication", {"use_tool": False}).example(random.Random(0)).demonstration is None
    with pytest.raises(ValueError, match="tool_format"):
        get_task("tool_multiplication", {"tool_format": "xml"})


def test_splits_do_not_leak_and_are_deterministic():
    cfg = DataCfg(task="addition", num_train=3000, num_val=100, seed=5)
    s1, s2 = build_splits(cfg), build_splits(cfg)
    assert [e.prompt for e in s1.val] == [e.prompt for e in s2.val]
    assert len(s1.val) == 100 and len({e.prompt for e in s1.val}) == 100
    assert not {e.prompt for e in s1.val} & {e.prompt for e in s1.train}


def test_sampler_resumes_at_its_cursor():
    examples = build_splits(DataCfg(num_train=50, num_val=5)).train
    a = PromptSampler(examples, seed=1)
    a.take(37)
    cursor = a.position
    expected = a.take(40)  # crosses an epoch boundary
    assert cursor == 37 and a.position == 77
    b = PromptSampler(examples, seed=1)
    b.seek(cursor)
    assert b.take(40) == expected
    c = PromptSampler(examples, seed=1)
    c.seek(77)
    assert c.take(5) == a.take(5)


def test_jsonl_loader(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2", "metadata": {"k": 1}}) + "\n\n"
                    + json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    rows = load_examples(path, DataCfg(task="jsonl", train_path=str(path)))
    assert [r.answer for r in rows] == ["2", "4"] and rows[0].metadata == {"k": 1}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "y"}\n{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_examples(bad, DataCfg(task="jsonl", train_path=str(bad)))
    splits = build_splits(DataCfg(task="jsonl", train_path=str(path), num_val=1))
    assert len(splits.train) + len(splits.val) == 2
