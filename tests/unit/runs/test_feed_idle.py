"""An idle run feed sleeps: with every run finished it looks again only when a run arrives, or after idle_s."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlserve.config import RunSpec
from rlserve.runs.feed import Arrivals, run_feed
from rlserve.runs.record import Run
from rlserve.v1 import coordinator_pb2 as pb


def _ids(batch) -> list[str]:  # noqa: ANN001 - a FeedBatch
    return [pb.Run.FromString(data).run_id for data in batch.runs]


def test_an_idle_feed_wakes_for_an_arrival_not_on_a_clock(tmp_path):
    async def main():
        runs = {"a": Run("a", RunSpec(), tmp_path / "a")}
        runs["a"].set_state(pb.RUN_STATE_SUCCEEDED)
        looks = 0

        def current() -> dict[str, Run]:
            nonlocal looks
            looks += 1
            return runs

        arrivals = Arrivals()
        feed = run_feed(current, interval_s=0.001, max_s=60, arrivals=arrivals, idle_s=30)
        assert _ids(await anext(feed)) == ["a"]
        nxt = asyncio.ensure_future(anext(feed))
        await asyncio.sleep(0.3)
        assert looks == 1 and not nxt.done()  # asleep since the first batch (not 300 looks)
        runs["b"] = Run("b", RunSpec(), tmp_path / "b")
        runs["b"].set_state(pb.RUN_STATE_QUEUED)
        t0 = time.monotonic()
        arrivals.note()
        assert _ids(await asyncio.wait_for(nxt, 5)) == ["b"] and time.monotonic() - t0 < 1
        await feed.aclose()
    asyncio.run(main())


def test_an_idle_feed_still_looks_after_idle_s_and_sends_a_change_made_without_an_arrival(tmp_path):
    async def main():
        runs = {"a": Run("a", RunSpec(), tmp_path / "a")}
        runs["a"].set_state(pb.RUN_STATE_SUCCEEDED)
        feed = run_feed(lambda: runs, interval_s=0.001, max_s=60, arrivals=Arrivals(), idle_s=0.2)
        await anext(feed)
        runs["a"].finish("/x/final", "")  # no event, no arrival: the look after idle_s checks every run
        batch = await asyncio.wait_for(anext(feed), 5)
        assert _ids(batch) == ["a"] and pb.Run.FromString(batch.runs[0]).final_model_path == "/x/final"
        await feed.aclose()
    asyncio.run(main())


def test_a_feed_that_waits_for_arrivals_needs_a_positive_idle_s(tmp_path):
    async def main():
        await anext(run_feed(lambda: {}, interval_s=0.1, max_s=1, arrivals=Arrivals(), idle_s=0))
    with pytest.raises(ValueError, match="idle_s"):
        asyncio.run(main())
