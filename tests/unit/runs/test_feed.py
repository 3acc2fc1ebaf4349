"""The run feed sends every run first, then only what changed, including a finished run changed later, and
each unfinished run's events once."""

from __future__ import annotations

import asyncio

from rlserve.config import RunSpec
from rlserve.runs import feed as feed_module
from rlserve.runs.feed import FeedBatch, run_feed
from rlserve.runs.record import Run
from rlserve.v1 import coordinator_pb2 as pb


def _ids(batch: FeedBatch) -> list[str]:
    return [pb.Run.FromString(data).run_id for data in batch.runs]


def _events(batch: FeedBatch) -> list[tuple[str, int]]:
    return [(ev.run_id, ev.sequence) for ev in map(pb.RunEvent.FromString, batch.events)]


def test_the_feed_sends_all_runs_then_each_change_once(tmp_path, monkeypatch):
    monkeypatch.setattr(feed_module, "FULL_CHECK_EVERY", 3)

    async def main():
        runs = {name: Run(name, RunSpec(), tmp_path / name) for name in ("a", "b")}
        runs["b"].set_state(pb.RUN_STATE_CANCELLED, "by test")
        feed = run_feed(lambda: runs, interval_s=0.01, max_s=60)
        assert _ids(await anext(feed)) == ["a", "b"]  # the first batch: everything
        runs["a"].record_step(4, 4, {"batch/trajectories_trained": 0.0})
        runs["c"] = Run("c", RunSpec(), tmp_path / "c")
        batch = await anext(feed)  # ticks without a change send nothing
        assert _ids(batch) == ["a", "c"] and pb.Run.FromString(batch.runs[0]).step == 4
        # A finished run whose record changes without an event (its `updated` unchanged) is still sent, by the
        # periodic full check.
        runs["b"].finish("/x/final", "")
        batch = await asyncio.wait_for(anext(feed), 5)
        assert _ids(batch) == ["b"] and pb.Run.FromString(batch.runs[0]).final_model_path == "/x/final"
        await feed.aclose()
    asyncio.run(main())


def test_a_feed_ends_after_its_lifetime(tmp_path):
    """No feed is held for good: the gateway opens the next, whose first batch rebuilds its copy."""
    async def main():
        runs = {"a": Run("a", RunSpec(), tmp_path / "a")}
        batches = [batch async for batch in run_feed(lambda: runs, interval_s=0.01, max_s=0.1)]
        assert _ids(batches[0]) == ["a"] and not any(b.runs or b.events for b in batches[1:])
    asyncio.run(asyncio.wait_for(main(), 10))


def test_unfinished_runs_events_are_sent_once_from_their_tail_and_a_finished_run_is_let_go(tmp_path, monkeypatch):
    """The gateway serves WatchRun from these: every event after the first batch's tail, in order, once; the
    event that ends a run is the last one read from it (its events may go to disk afterwards)."""
    monkeypatch.setattr(feed_module, "EVENTS_TAIL", 3)

    async def main():
        runs = {name: Run(name, RunSpec(), tmp_path / name) for name in ("a", "b")}
        for i in range(5):
            runs["a"].emit(pb.EVENT_KIND_STEP, f"step {i}")
        runs["b"].set_state(pb.RUN_STATE_CANCELLED, "by test")
        feed = run_feed(lambda: runs, interval_s=0.01, max_s=60)
        assert _events(await anext(feed)) == [("a", 2), ("a", 3), ("a", 4)]  # a's tail; b ended before
        runs["a"].emit(pb.EVENT_KIND_STEP, "step 5")
        runs["a"].set_state(pb.RUN_STATE_SUCCEEDED)
        batch = await anext(feed)
        assert _events(batch) == [("a", 5), ("a", 6)] and _ids(batch) == ["a"]
        runs["a"]._events = None  # let go to disk: the feed must not read it back
        runs["a"].recorder = None
        runs["c"] = Run("c", RunSpec(), tmp_path / "c")
        batch = await asyncio.wait_for(anext(feed), 5)
        assert _ids(batch) == ["c"] and not batch.events
        await feed.aclose()
    asyncio.run(main())
