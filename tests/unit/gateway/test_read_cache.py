"""The gateway's read cache on its own: identical calls of one caller share a forwarded call and, for ttl_s,
its answer; answers never cross callers; any write makes every answer (and reads forwarded before it) old;
failures are not kept; a caller that goes away does not take the answer from the others; the bytes held
are bounded."""

from __future__ import annotations

import asyncio

import pytest

from rlserve.gateway.read_cache import ReadCache


class Backend:
    """Counts forwarded calls; each answer names the call's number, so tests can tell answers apart."""

    def __init__(self, delay_s: float = 0.0):
        self.calls = 0
        self.delay_s = delay_s
        self.fail = False

    def fetch(self, tag: str = ""):
        async def call() -> bytes:
            self.calls += 1
            n = self.calls
            await asyncio.sleep(self.delay_s)
            if self.fail:
                raise RuntimeError("coordinator unavailable")
            return f"{tag}answer {n}".encode()
        return call


def test_concurrent_identical_calls_share_one_forwarded_call_and_later_ones_its_answer():
    async def main():
        cache, backend = ReadCache(ttl_s=0.3), Backend(delay_s=0.05)
        answers = await asyncio.gather(*(cache.get("alice", "GetRun", b"r", backend.fetch()) for _ in range(50)))
        assert backend.calls == 1 and set(answers) == {b"answer 1"}
        assert await cache.get("alice", "GetRun", b"r", backend.fetch()) == b"answer 1"
        await cache.get("alice", "GetRun", b"other run", backend.fetch())
        assert backend.calls == 2  # another request is another key
        await asyncio.sleep(0.35)
        assert await cache.get("alice", "GetRun", b"r", backend.fetch()) == b"answer 3"
    asyncio.run(main())


def test_answers_never_cross_callers():
    async def main():
        cache, backend = ReadCache(ttl_s=10), Backend(delay_s=0.05)
        alice, bob = await asyncio.gather(cache.get("alice", "ListRuns", b"", backend.fetch("alice's ")),
                                          cache.get("bob", "ListRuns", b"", backend.fetch("bob's ")))
        assert (alice, bob) == (b"alice's answer 1", b"bob's answer 2")
        assert await cache.get("bob", "ListRuns", b"", backend.fetch("bob's ")) == b"bob's answer 2"
    asyncio.run(main())


def test_any_write_makes_every_answer_and_reads_forwarded_before_it_old():
    async def main():
        cache, backend = ReadCache(ttl_s=10), Backend(delay_s=0.1)
        assert await cache.get("alice", "GetRun", b"r", backend.fetch()) == b"answer 1"
        assert await cache.get("root", "ListRuns", b"", backend.fetch()) == b"answer 2"
        cache.wrote()  # e.g. alice submitted a run: root's listing must show it
        assert await cache.get("alice", "GetRun", b"r", backend.fetch()) == b"answer 3"
        assert await cache.get("root", "ListRuns", b"", backend.fetch()) == b"answer 4"
        # A read forwarded before a write is not joined by a read after it, nor kept.
        before = asyncio.ensure_future(cache.get("alice", "GetRun", b"x", backend.fetch()))
        await asyncio.sleep(0.02)
        cache.wrote()
        after = await cache.get("alice", "GetRun", b"x", backend.fetch())
        assert (await before, after) == (b"answer 5", b"answer 6")
        assert await cache.get("alice", "GetRun", b"x", backend.fetch()) == b"answer 6"
        assert backend.calls == 6
    asyncio.run(main())


def test_failures_reach_every_waiter_and_are_not_kept():
    async def main():
        cache, backend = ReadCache(ttl_s=10), Backend(delay_s=0.05)
        backend.fail = True
        results = await asyncio.gather(*(cache.get("alice", "GetRun", b"r", backend.fetch()) for _ in range(5)),
                                       return_exceptions=True)
        assert backend.calls == 1 and all(isinstance(r, RuntimeError) for r in results)
        backend.fail = False
        assert await cache.get("alice", "GetRun", b"r", backend.fetch()) == b"answer 2"
    asyncio.run(main())


def test_a_caller_that_goes_away_does_not_take_the_answer_from_the_others():
    async def main():
        cache, backend = ReadCache(ttl_s=10), Backend(delay_s=0.1)
        first = asyncio.ensure_future(cache.get("alice", "GetRun", b"r", backend.fetch()))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(cache.get("alice", "GetRun", b"r", backend.fetch()))
        await asyncio.sleep(0.01)
        first.cancel()
        assert await second == b"answer 1" and backend.calls == 1
        with pytest.raises(asyncio.CancelledError):
            await first
    asyncio.run(main())


def test_the_bytes_held_are_bounded_oldest_first():
    async def main():
        cache, backend = ReadCache(ttl_s=10, max_bytes=30), Backend()
        for run in (b"a", b"b", b"c"):  # 8 bytes an answer: the first goes at the fourth
            await cache.get("alice", "GetRun", run, backend.fetch())
        await cache.get("alice", "GetRun", b"d", backend.fetch())
        assert await cache.get("alice", "GetRun", b"b", backend.fetch()) == b"answer 2"
        assert await cache.get("alice", "GetRun", b"a", backend.fetch()) == b"answer 5"
        assert cache._bytes <= 30
    asyncio.run(main())


def test_with_no_ttl_only_calls_in_flight_are_shared_and_a_write_still_splits_them():
    async def main():
        cache, backend = ReadCache(ttl_s=0), Backend(delay_s=0.1)
        shared = await asyncio.gather(*(cache.get("alice", "GetRun", b"x", backend.fetch()) for _ in range(3)))
        assert shared == [b"answer 1"] * 3
        assert await cache.get("alice", "GetRun", b"x", backend.fetch()) == b"answer 2"
        before = asyncio.ensure_future(cache.get("alice", "GetRun", b"x", backend.fetch()))
        await asyncio.sleep(0.02)
        cache.wrote()
        after = await cache.get("alice", "GetRun", b"x", backend.fetch())
        assert (await before, after) == (b"answer 3", b"answer 4")
    asyncio.run(main())
