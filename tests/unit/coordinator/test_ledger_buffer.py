"""The ledger balances, and the replay buffer enforces the staleness bound."""

from __future__ import annotations

import asyncio

import pytest

from services.coordinator.buffer import Group, ReplayBuffer, is_fresh
from services.coordinator.ledger import Ledger


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
    assert is_fresh(group(5), 5, max_age)
    assert is_fresh(group(5 - max_age), 5, max_age)
    assert not is_fresh(group(4 - max_age), 5, max_age)


def test_buffer_take_waits_and_splits_stale():
    async def scenario():
        buf = ReplayBuffer()
        taker = asyncio.create_task(buf.take(3, version=4, max_age=1))
        await buf.put([group(4), group(2)])
        await asyncio.sleep(0.01)
        assert not taker.done()
        await buf.put([group(3), group(4)])
        fresh, stale = await taker
        assert [g.weight_version for g in fresh] == [4, 3]
        assert [g.weight_version for g in stale] == [2]
        assert len(buf) == 1
    asyncio.run(scenario())
