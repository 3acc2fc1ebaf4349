"""The staleness rule, the producer gate it implies, and the step queue that enforces both."""

from __future__ import annotations

import asyncio

import pytest

from rlserve.grpo.groups import Group, ProducedStep, StepQueue, summarize_errors
from rlserve.grpo.staleness import StalenessBound


def group(version: int) -> Group:
    return Group(prompt_index=0, prompt_ids=[1], completions=[[2], [3]], gen_logprobs=[[-1.0], [-1.0]],
                 rewards=[0.0, 1.0], weight_version=version)


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
        queue.advance(1)
        await asyncio.wait_for(gate, 1)
    asyncio.run(scenario())


def test_error_summary_shows_the_first_messages_and_counts_the_rest():
    messages = ["A"] * 3 + ["B"] + [f"C{i}" for i in range(5)]
    assert summarize_errors(messages, 2) == "A (x3); B; 5 other messages (5 errors) not shown"
    assert summarize_errors(["A", "A"], 3) == "A (x2)"
