"""The ledger balances, and the group queue and the producer gate enforce the staleness bound."""

from __future__ import annotations

import asyncio

import pytest

from services.coordinator.groups import Group, GroupQueue
from services.coordinator.ledger import Ledger
from services.coordinator.staleness import StalenessBound


def group(version: int) -> Group:
    return Group(prompt_index=0, prompt_ids=[1], completions=[[2], [3]], gen_logprobs=[[-1.0], [-1.0]],
                 rewards=[0.0, 1.0], weight_version=version, step=version)


def test_ledger_balances_and_refuses_overdraw():
    ledger = Ledger()
    ledger.generated += 10
    ledger.train(6)
    ledger.drop("stale", 3)
    assert ledger.in_flight == 1 and not ledger.balanced()
    with pytest.raises(ValueError):
        ledger.drop("stale", 2)
    ledger.drop("zero_advantage", 1)
    assert ledger.balanced()
    assert Ledger.from_dict(ledger.to_dict()).to_dict() == ledger.to_dict()


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


def test_buffer_take_waits_and_splits_stale():
    async def scenario():
        buf = GroupQueue()
        taker = asyncio.create_task(buf.take(3, version=4, bound=StalenessBound(1)))
        buf.put([group(4), group(2)])
        await asyncio.sleep(0.01)
        assert not taker.done()
        buf.put([group(3), group(4)])
        fresh, stale = await taker
        assert [g.weight_version for g in fresh] == [4, 3]
        assert [g.weight_version for g in stale] == [2]
        assert len(buf) == 1
    asyncio.run(scenario())
