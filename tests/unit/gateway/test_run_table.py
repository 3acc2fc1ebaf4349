"""What the gateway's run table answers itself and what it leaves to the coordinator."""

from __future__ import annotations

from rlserve.gateway.run_table import RunTable
from rlserve.security.principal import Principal, Role
from rlserve.v1 import coordinator_pb2 as pb

ALICE, BOB, ADMIN = Principal("alice", Role.USER), Principal("bob", Role.USER), Principal("root", Role.ADMIN)


def _run(run_id: str, owner: str, updated: float, step: int = 0) -> pb.Run:
    return pb.Run(run_id=run_id, owner=owner, updated_unix=updated, step=step)


def _get(table: RunTable, run_id: str, caller: Principal | None) -> pb.Run | None:
    answer = table.answer("GetRun", pb.GetRunRequest(run_id=run_id), caller)
    return None if answer is None else answer.run


def test_reads_are_answered_only_from_a_live_table_and_only_with_what_the_caller_may_see():
    table = RunTable()
    records = [_run("a1", "alice", 10).SerializeToString(), _run("b1", "bob", 10).SerializeToString()]
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
    table.replace([_run("a1", "alice", 10, step=1).SerializeToString()])
    table.learn(pb.CancelRunResponse(run=_run("a1", "alice", 12, step=2)))  # a write's answer, forwarded
    table.update([_run("a1", "alice", 11, step=1).SerializeToString()])  # a feed batch made before the write
    assert _get(table, "a1", ALICE).step == 2
    table.learn(pb.SubmitRunResponse(run=_run("a2", "alice", 13)))
    assert [r.run_id for r in table.answer("ListRuns", pb.ListRunsRequest(), ALICE).runs] == ["a1", "a2"]
    # The next feed's first batch, made just before the write reached the coordinator: the write stays.
    table.replace([_run("a1", "alice", 11, step=1).SerializeToString(), _run("a2", "alice", 13).SerializeToString()])
    assert _get(table, "a1", ALICE).step == 2


def test_a_run_whose_newer_event_passed_through_a_stream_is_forwarded_until_the_table_catches_up():
    table = RunTable()
    table.replace([_run("a1", "alice", 10).SerializeToString(), _run("a2", "alice", 10).SerializeToString()])
    table.learn(pb.WatchRunResponse(event=pb.RunEvent(run_id="a1", time_unix=20, state=pb.RUN_STATE_SUCCEEDED)))
    assert _get(table, "a1", ALICE) is None and _get(table, "a2", ALICE) is not None
    assert table.answer("ListRuns", pb.ListRunsRequest(), ALICE) is None
    table.update([_run("a1", "alice", 20).SerializeToString()])
    assert _get(table, "a1", ALICE) is not None
    assert len(table.answer("ListRuns", pb.ListRunsRequest(), ALICE).runs) == 2
