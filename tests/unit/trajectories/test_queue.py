"""The staleness rule, the producer gate it implies, and the step queue that enforces both."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rlserve.trajectories.queue import ProducedStep, StepQueue, saved_steps, summarize_errors
from rlserve.trajectories.staleness import StalenessBound
from rlserve.trajectories.trajectory import Group, Trajectory


def group(version: int) -> Group:
    return Group(prompt_index=0, prompt_ids=[1], weight_version=version, trajectories=[
        Trajectory(tokens=[2], logprobs=[-1.0], mask=[True], reward=0.0),
        Trajectory(tokens=[3], logprobs=[-1.0], mask=[True], reward=1.0)])


@pytest.mark.parametrize("max_age", [0, 1, 2])
def test_staleness_rule(max_age):
    bound = StalenessBound(max_age)
    assert bound.is_fresh(5, 5)
    assert bound.is_fresh(5, 5 - max_age)
    assert not bound.is_fresh(5, 4 - max_age)


@pytest.mark.parametrize("max_age", [0, 1, 2])
@pytest.mark.parametrize("trains", ["every step", "every other step", "never"])
def test_producer_gate_keeps_every_batch_fresh(max_age, trains):
    """Simulate the loop in versions: the gate never lets a batch be older than the bound when trained,
    also when steps train nothing (the version then stands still while the steps go on)."""
    bound = StalenessBound(max_age)
    version, consumed, produced, batches = 0, 0, 0, []
    for _ in range(40):
        if bound.may_generate(produced - consumed):
            batches.append(version)
            produced += 1
        elif batches:
            generated = batches.pop(0)
            assert bound.is_fresh(version, generated), (version, generated)
            if trains == "every step" or trains == "every other step" and consumed % 2 == 0:
                version += 1
            consumed += 1
    assert consumed >= 10  # the gate never blocks for good


def test_the_queue_hands_over_steps_in_order_and_gates_the_producer():
    async def scenario():
        queue = StepQueue(StalenessBound(1))
        taker = asyncio.create_task(queue.take())
        await asyncio.sleep(0.01)
        assert not taker.done()
        queue.put(ProducedStep(0, [group(0)]))
        queue.put(ProducedStep(1, [group(0), group(0)]))
        assert (await taker).step == 0 and len(queue) == 1 and queue.snapshot()[0].size == 4
        await asyncio.wait_for(queue.wait_turn(1), 1)  # one step ahead of the trainer: allowed
        gate = asyncio.create_task(queue.wait_turn(2))
        await asyncio.sleep(0.01)
        assert not gate.done()  # two ahead: held back until the trainer moves
        queue.advance(1, version=1)
        await asyncio.wait_for(gate, 1)
        assert queue.version == 1  # the producer asks the engines for at least this version
    asyncio.run(scenario())


def test_a_checkpointed_queue_reads_back_in_either_layout():
    """The queue as this code saves it, and as checkpoints from before trajectories had one type saved it
    (per-sample lists on the group, and before that a flat list of groups naming their step)."""
    step = ProducedStep(3, [group(2)], {"timing/generate_s": 1.0}, data_cursor=12)
    assert saved_steps([dataclasses.asdict(step)]) == [step]
    old_group = {"prompt_index": 12, "prompt_ids": [1], "completions": [[2], [3, 4]],
                 "gen_logprobs": [[-1.0], [-1.0, -2.0]], "rewards": [0.0, 1.0], "weight_version": 2,
                 "ref_logprobs": None, "reward_errors": [], "reward_metrics": [], "mixed_samples": 0,
                 "version_spread": 0, "loss_masks": None, "endings": [], "turns": [], "episode_metrics": [],
                 "env_failures": []}
    for saved in ([{"step": 3, "groups": [old_group], "metrics": {}, "data_cursor": 12}],
                  [{**old_group, "step": 3, "ids": ["r/3/12/0", "r/3/12/1"]}]):
        (read,) = saved_steps(saved)
        (g,) = read.groups
        assert (read.step, read.data_cursor, g.rewards, g.weight_version) == (3, 12, [0.0, 1.0], 2)
        assert [t.tokens for t in g.trajectories] == [[2], [3, 4]] and g.trajectories[1].mask == [True, True]


def test_error_summary_shows_the_first_messages_and_counts_the_rest():
    messages = ["A"] * 3 + ["B"] + [f"C{i}" for i in range(5)]
    assert summarize_errors(messages, 2) == "A (x3); B; 5 other messages (5 errors) not shown"
    assert summarize_errors(["A", "A"], 3) == "A (x2)"
