"""The run feed sends every run first, then only what changed, including a finished run changed later."""

from __future__ import annotations

import asyncio

from rlserve.config import RunSpec
from rlserve.runs import feed as feed_module
from rlserve.runs.feed import run_feed
from rlserve.runs.record import Run
from rlserve.v1 import coordinator_pb2 as pb


def _ids(batch: list[bytes]) -> list[str]:
    return [pb.Run.FromString(data).run_id for data in batch]


def test_the_feed_sends_all_runs_then_each_change_once(tmp_path, monkeypatch):
    monkeypatch.setattr(feed_module, "FULL_CHECK_EVERY", 3)

    async def main():
        runs = {name: Run(name, RunSpec(), tmp_path / name) for name in ("a", "b")}
        runs["b"].set_state(pb.RUN_STATE_CANCELLED, "by test")
        feed = run_feed(lambda: runs, interval_s=0.01, max_s=60)
        assert _ids(await anext(feed)) == ["a", "b"]  # the first batch: everything
        runs["a"].step = 4
        runs["c"] = Run("c", RunSpec(), tmp_path / "c")
        batch = await anext(feed)  # ticks without a change send nothing
        assert _ids(batch) == ["a", "c"] and pb.Run.FromString(batch[0]).step == 4
        # A finished run whose record changes without an event (its `updated` unchanged) is still sent, by the
        # periodic full check.
        runs["b"].final_model_path = "/x/final"
        batch = await asyncio.wait_for(anext(feed), 5)
        assert _ids(batch) == ["b"] and pb.Run.FromString(batch[0]).final_model_path == "/x/final"
        await feed.aclose()
    asyncio.run(main())


def test_a_feed_ends_after_its_lifetime(tmp_path):
    """No feed is held for good: the gateway opens the next, whose first batch rebuilds its copy."""
    async def main():
        runs = {"a": Run("a", RunSpec(), tmp_path / "a")}
        batches = [batch async for batch in run_feed(lambda: runs, interval_s=0.01, max_s=0.1)]
        assert _ids(batches[0]) == ["a"] and not any(batches[1:])
    asyncio.run(asyncio.wait_for(main(), 10))
