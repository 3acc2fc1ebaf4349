"""Weighted fair share by use (`rlserve.tenancy.fair_share`), on a model of a continuously batching engine.

The model: `capacity` slots; every tick, each running sequence makes one token and a sequence that
has made its length frees its slot. Each run keeps more requests open than the engine holds
(backlogged, the case fair queueing's guarantee is about), as a GRPO producer with work queued does. A run's share is the tokens its sequences made. First come, first
served (`Fifo` below) is measured beside it in each test, so the tests show the difference they assert.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from rlserve.tenancy.fair_share import FairShare


class Fifo:
    """First come, first served: what a plain queue in front of the engine gives."""

    def __init__(self, capacity: int):
        self.slots = asyncio.Semaphore(capacity)

    async def acquire(self, run_id: str, weight: float, units: int = 1, estimate: float = 0.0):
        await self.slots.acquire()

    def release(self, grant, used: float) -> None:
        self.slots.release()


async def _simulate(gate, runs: dict[str, tuple[int, float]], ticks: int, clients: int = 8,
                    capacity: int = 4, late: dict[str, int] | None = None) -> dict[str, int]:
    """Tokens made per run over the last half of `ticks`; `runs`: run -> (completion length, weight);
    `late`: run -> the tick it starts sending at."""
    running: list[list] = []  # [run, tokens left, grant, done event]
    made: dict[str, int] = defaultdict(int)
    tick = 0
    started = {run: asyncio.Event() for run in runs}

    async def client(run: str, length: int, weight: float) -> None:
        await started[run].wait()
        while True:
            grant = await gate.acquire(run, weight, 1, 64.0)
            done = asyncio.Event()
            running.append([run, length, grant, done])
            await done.wait()

    tasks = [asyncio.create_task(client(run, length, weight))
             for run, (length, weight) in runs.items() for _ in range(clients)]
    for tick in range(ticks):
        for run in runs:
            if tick >= (late or {}).get(run, 0):
                started[run].set()
        for _ in range(5):
            await asyncio.sleep(0)  # clients take the slots freed
        assert len(running) <= capacity or len({r[0] for r in running}) == 1
        for seq in running:
            seq[1] -= 1
            if tick >= ticks // 2:
                made[seq[0]] += 1
        for seq in [s for s in running if s[1] == 0]:
            running.remove(seq)
            gate.release(seq[2], float(runs[seq[0]][0]))
            seq[3].set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return dict(made)


def test_a_run_with_10x_longer_completions_gets_the_same_tokens_not_the_slots():
    runs = {"short": (10, 1.0), "long": (100, 1.0)}
    fair = asyncio.run(_simulate(FairShare(4), runs, 4000))
    fifo = asyncio.run(_simulate(Fifo(4), runs, 4000))
    assert fifo["long"] / fifo["short"] > 4  # in turns of requests, the long run holds the slots
    assert 0.8 < fair["long"] / fair["short"] < 1.25, fair
    # Without the linger, the moment a run's requests have all ended it counts as gone, and the other
    # floods the engine then.
    no_linger = asyncio.run(_simulate(FairShare(4, linger_s=0.0), runs, 4000))
    assert no_linger["long"] / no_linger["short"] > 4


def test_priority_weights_the_share():
    runs = {"a": (20, 2.0), "b": (20, 1.0)}
    fair = asyncio.run(_simulate(FairShare(4), runs, 4000))
    fifo = asyncio.run(_simulate(Fifo(4), runs, 4000))
    assert 0.8 < fifo["a"] / fifo["b"] < 1.25
    assert 1.6 < fair["a"] / fair["b"] < 2.5, fair


def test_a_run_that_was_idle_banks_no_credit():
    """`late` joins after `early` has made 2000 tokens alone; from then on they split the engine, rather
    than `late` taking it all until it has caught up."""
    made = asyncio.run(_simulate(FairShare(4), {"early": (20, 1.0), "late": (20, 1.0)}, 4000,
                                 late={"late": 2000}))
    assert 0.8 < made["late"] / made["early"] < 1.25, made


def test_a_run_alone_is_never_held_back():
    async def main():
        share = FairShare(2)
        grants = await asyncio.wait_for(asyncio.gather(*[share.acquire("solo", 1.0, 3) for _ in range(5)]), 1)
        assert len(grants) == 5  # 15 units on a capacity of 2: alone, nothing waits
        other = asyncio.create_task(share.acquire("other", 1.0, 1))
        await asyncio.sleep(0.01)
        assert not other.done()  # now it shares: the engine is over capacity
        for g in grants[:4]:
            share.release(g, 10.0)
        await asyncio.sleep(0)
        assert not other.done()
        share.release(grants[4], 10.0)
        await asyncio.wait_for(other, 1)
    asyncio.run(main())


def test_a_request_starts_whenever_a_unit_is_free_whatever_its_size():
    """Units stay taken until a request's last sequence ends: the next starts as soon as one is free, so the
    engine never idles behind a long request's tail."""
    async def main():
        share = FairShare(4)
        big = await share.acquire("a", 1.0, 3)
        other = await asyncio.wait_for(share.acquire("b", 1.0, 9), 1)  # 3 of 4 taken: one is free
        late = asyncio.create_task(share.acquire("c", 1.0, 1))
        await asyncio.sleep(0.01)
        assert not late.done()  # 12 taken
        share.release(other, 1.0)
        await asyncio.wait_for(late, 1)
        share.release(big, 1.0)
    asyncio.run(main())


@pytest.mark.parametrize("released_first", [False, True])
def test_a_cancelled_wait_leaves_no_trace(released_first):
    """`released_first`: the unit is released after the waiting task was cancelled, before it ran again (its
    wait is cancelled at once, its handler runs a moment later). That once let the cancelled request in:
    InvalidStateError in the releasing request, the unit taken for good, the next run's request held forever."""
    async def main():
        share = FairShare(1, linger_s=0.0)
        held = await share.acquire("a", 1.0)
        waiting = asyncio.create_task(share.acquire("b", 1.0))
        queued = asyncio.create_task(share.acquire("c", 1.0))
        await asyncio.sleep(0.01)
        waiting.cancel()
        if released_first:
            share.release(held, 1.0)
        await asyncio.gather(waiting, return_exceptions=True)
        if not released_first:
            share.release(held, 1.0)
        assert waiting.cancelled()
        share.release(await asyncio.wait_for(queued, 1), 1.0)
        assert not share._runs  # every run gone and owing nothing: nothing kept
    asyncio.run(main())


@pytest.mark.parametrize("weight", [0.0, -1.0, 101.0])
def test_weights_out_of_range_are_refused(weight):
    with pytest.raises(ValueError, match="weight"):
        asyncio.run(FairShare(1).acquire("a", weight))


def test_an_exclusive_resource_runs_one_request_at_a_time_even_for_a_run_alone():
    async def main():
        share = FairShare(1, exclusive=True)
        first = await share.acquire("solo", 1.0)
        second = asyncio.create_task(share.acquire("solo", 1.0))
        await asyncio.sleep(0.01)
        assert not second.done()
        share.release(first, 0.5)
        share.release(await asyncio.wait_for(second, 1), 0.5)
    asyncio.run(main())
