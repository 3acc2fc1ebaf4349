"""What the gateway's run table answers itself (reads and watches) and what it leaves to the coordinator."""

from __future__ import annotations

import asyncio

import pytest

from rlserve.gateway.run_events import NotHeld
from rlserve.gateway.run_table import RunTable
from rlserve.runs.feed import EVENTS_TAIL, FeedBatch
from rlserve.security.principal import Principal, Role
from rlserve.v1 import coordinator_pb2 as pb

ALICE, BOB, ADMIN = Principal("alice", Role.USER), Principal("bob", Role.USER), Principal("root", Role.ADMIN)


def _run(run_id: str, owner: str, updated: float, step: int = 0) -> pb.Run:
    return pb.Run(run_id=run_id, owner=owner, updated_unix=updated, step=step)


def _batch(*runs: pb.Run, events: tuple[pb.RunEvent, ...] = ()) -> FeedBatch:
    return FeedBatch([r.SerializeToString() for r in runs], [ev.SerializeToString() for ev in events])


def _get(table: RunTable, run_id: str, caller: Principal | None) -> pb.Run | None:
    answer = table.answer("GetRun", pb.GetRunRequest(run_id=run_id), caller)
    return None if answer is None else answer.run


def test_reads_are_answered_only_from_a_live_table_and_only_with_what_the_caller_may_see():
    table = RunTable()
    records = _batch(_run("a1", "alice", 10), _run("b1", "bob", 10))
    assert _get(table, "a1", ALICE) is None  # no feed yet
    table.replace(records)
    assert _get(table, "a1", ALICE).owner == "alice"
    assert _get(table, "b1", ALICE) is None  # the coordinator says NOT_FOUND, exactly as for a missing run
    assert _get(table, "nope", ALICE) is None
    assert [r.run_id for r in table.answer("ListRuns", pb.ListRunsRequest(), BOB).runs] == ["b1"]
    assert [r.run_id for r in table.answer("ListRuns", pb.ListRunsRequest(), ADMIN).runs] == ["a1", "b1"]
    assert [r.run_id for r in table.answer("ListRuns", pb.ListRunsRequest(), None).runs] == ["a1", "b1"]
    assert table.answer("CancelRun", pb.CancelRunRequest(run_id="a1"), ALICE) is None
    table.down()
    assert _get(table, "a1", ALICE) is None and table.answer("ListRuns", pb.ListRunsRequest(), ADMIN) is None


def test_an_older_record_never_replaces_a_newer_one_and_a_caller_reads_its_own_writes():
    table = RunTable()
    table.replace(_batch(_run("a1", "alice", 10, step=1)))
    table.learn(pb.CancelRunResponse(run=_run("a1", "alice", 12, step=2)))  # a write's answer, forwarded
    table.update(_batch(_run("a1", "alice", 11, step=1)))  # a feed batch made before the write
    assert _get(table, "a1", ALICE).step == 2
    table.learn(pb.SubmitRunResponse(run=_run("a2", "alice", 13)))
    assert [r.run_id for r in table.answer("ListRuns", pb.ListRunsRequest(), ALICE).runs] == ["a1", "a2"]
    # The next feed's first batch, made just before the write reached the coordinator: the write stays.
    table.replace(_batch(_run("a1", "alice", 11, step=1), _run("a2", "alice", 13)))
    assert _get(table, "a1", ALICE).step == 2


def test_a_run_whose_newer_event_passed_through_a_stream_is_forwarded_until_the_table_catches_up():
    table = RunTable()
    table.replace(_batch(_run("a1", "alice", 10), _run("a2", "alice", 10)))
    table.learn(pb.WatchRunResponse(event=pb.RunEvent(run_id="a1", time_unix=20, state=pb.RUN_STATE_SUCCEEDED)))
    assert _get(table, "a1", ALICE) is None and _get(table, "a2", ALICE) is not None
    assert table.answer("ListRuns", pb.ListRunsRequest(), ALICE) is None
    table.update(_batch(_run("a1", "alice", 20)))
    assert _get(table, "a1", ALICE) is not None
    assert len(table.answer("ListRuns", pb.ListRunsRequest(), ALICE).runs) == 2


def _ev(run_id: str, seq: int, state: int = pb.RUN_STATE_RUNNING) -> pb.RunEvent:
    return pb.RunEvent(run_id=run_id, sequence=seq, state=state, time_unix=float(seq))


async def _take(events, n: int) -> list[int]:
    return [(await asyncio.wait_for(anext(events), 5)).sequence for _ in range(n)]


def test_a_watch_is_served_from_the_copy_while_it_holds_the_next_event_and_ends_with_the_run():
    async def main():
        table = RunTable()
        table.replace(_batch(_run("a1", "alice", 10), _run("b1", "bob", 10), events=(_ev("a1", 4), _ev("a1", 5))))
        assert table.watch(pb.WatchRunRequest(run_id="a1", from_sequence=3), ALICE, 60) is None  # before the tail
        assert table.watch(pb.WatchRunRequest(run_id="a1", from_sequence=4), BOB, 60) is None  # not bob's
        assert table.watch(pb.WatchRunRequest(run_id="b1"), BOB, 60) is None  # no events held
        events = table.watch(pb.WatchRunRequest(run_id="a1", from_sequence=4), ALICE, 60)
        assert await _take(events, 2) == [4, 5]
        waiting = asyncio.ensure_future(_take(events, 2))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # idle: waiting for the run's next event
        table.update(_batch(events=(_ev("a1", 5), _ev("a1", 6), _ev("a1", 7, pb.RUN_STATE_SUCCEEDED))))
        assert await waiting == [6, 7]  # the repeated 5 is not sent twice
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(events), 5)  # the run ended
        idle = table.watch(pb.WatchRunRequest(run_id="a1", from_sequence=10**12), ALICE, 60)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(idle), 5)  # past the end of an ended run: ends at once
        quiet = table.watch(pb.WatchRunRequest(run_id="a1", from_sequence=8), ADMIN, 0.05)
        table.update(_batch(events=(_ev("a1", 8),)))  # resumed
        assert await _take(quiet, 1) == [8]
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(quiet), 5)  # its lifetime is over
    asyncio.run(main())


def test_a_watcher_the_copy_can_no_longer_serve_is_told_to_continue_forwarded():
    """The feed going down, the next feed letting the run go, a gap in its events, or a watcher slower than
    the tail is long: `NotHeld`, after the last event sent, so the rest is forwarded from the next one."""
    async def main():
        table = RunTable()
        table.replace(_batch(_run("a1", "alice", 10), events=(_ev("a1", 0),)))
        down = table.watch(pb.WatchRunRequest(run_id="a1"), ALICE, 60)
        assert await _take(down, 1) == [0]
        waiting = asyncio.ensure_future(anext(down))
        await asyncio.sleep(0.05)
        table.down()
        with pytest.raises(NotHeld):
            await asyncio.wait_for(waiting, 5)
        table.replace(_batch(_run("a1", "alice", 10), events=(_ev("a1", 0),)))
        gap = table.watch(pb.WatchRunRequest(run_id="a1"), ALICE, 60)
        assert await _take(gap, 1) == [0]
        table.update(_batch(events=(_ev("a1", 3),)))  # 1 and 2 never came: the copy starts again at 3
        with pytest.raises(NotHeld):
            await asyncio.wait_for(anext(gap), 5)
        slow = table.watch(pb.WatchRunRequest(run_id="a1", from_sequence=3), ALICE, 60)
        assert await _take(slow, 1) == [3]
        table.update(_batch(events=tuple(_ev("a1", s) for s in range(4, 4 + EVENTS_TAIL + 1))))
        with pytest.raises(NotHeld):  # 4 fell out of the tail while the watcher was away
            await asyncio.wait_for(anext(slow), 5)
        table.replace(_batch(_run("a1", "alice", 10)))  # the next feed: the run has no events to follow
        assert table.watch(pb.WatchRunRequest(run_id="a1", from_sequence=3 + EVENTS_TAIL), ALICE, 60) is None
    asyncio.run(main())
