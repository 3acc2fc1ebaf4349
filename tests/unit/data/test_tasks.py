"""Synthetic tasks and data sets: seeded, verifiable, split without leakage."""

from __future__ import annotations

import json
import random

import pytest

from rlserve.config.spec import DataCfg
from rlserve.data.dataset import PromptSampler, build_splits
from rlserve.data.files import load_examples
from rlserve.data.tasks import TASKS, get_task
from rlserve.models.tokenizer import ALPHABET
from rlserve.rewards.builtins import Countdown, ExactMatch
from rlserve.rewards.interfaces import RewardInput


@pytest.mark.parametrize("name", sorted(TASKS))
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
