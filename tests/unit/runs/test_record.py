"""Run history: the ledger's rewind to a checkpoint, metrics/TensorBoard rewind, runs reloaded by a
restarted coordinator, and the manager's queue and cancellation."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from rlserve.config import spec_to_yaml
from rlserve.config.spec import RunSpec
from rlserve.runs.ledger import Ledger
from rlserve.runs.manager import Admission, RunManager
from rlserve.runs.record import TERMINAL, Run
from rlserve.runs.recorder import Recorder
from rlserve.security.principal import SYSTEM
from rlserve.v1 import coordinator_pb2 as pb


def test_rewind_drops_what_came_after_the_checkpoint_and_keeps_its_buffer_in_flight():
    ledger = Ledger()
    ledger.generate(64)
    ledger.train(24)
    ledger.drop("zero_advantage", 8)
    checkpoint = Ledger.from_dict(ledger.to_dict())  # 32 in flight: the checkpoint's buffered groups
    ledger.generate(32)
    ledger.train(28)
    ledger.drop("stale", 4)
    ledger.drop("zero_advantage", 4)
    after, changes = ledger.rewind(checkpoint)
    assert (after.generated, after.trained, after.in_flight) == (96, 24, 32)
    assert after.dropped == Counter({"zero_advantage": 8, "recovered": 32})
    assert changes == {"dropped/recovered": 32.0, "dropped/stale": -4.0, "dropped/zero_advantage": -4.0,
                       "trained": -28.0}
    # The changes are exactly the difference: announcing them keeps event sums equal to the ledger.
    for reason in set(after.dropped) | set(ledger.dropped):
        assert after.dropped[reason] - ledger.dropped[reason] == changes.get(f"dropped/{reason}", 0.0)
    # A second loss before the next checkpoint rewinds to the same checkpoint again.
    after.generate(32)
    after.train(60)
    again, changes = after.rewind(checkpoint)
    assert again.dropped["recovered"] == 64 and again.trained == 24 and again.in_flight == 32
    assert changes == {"dropped/recovered": 32.0, "trained": -60.0}
    with pytest.raises(ValueError):
        checkpoint.rewind(again)  # a checkpoint ahead of the run is a bug, not a rewind


def test_rewind_keeps_each_step_once_in_metrics_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec = Recorder(tmp_path, tensorboard=True)
    for step in range(0, 5):
        rec.metrics(step, {"reward/mean": float(step)})
    rec.rewind(2)  # resumed from the checkpoint of step 2: steps 3 and 4 are redone
    for step in range(3, 6):
        rec.metrics(step, {"reward/mean": 10.0 + step})
    rec.close()
    assert [(r["step"], r["reward/mean"]) for r in rec.read("metrics.jsonl")] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    tb = EventAccumulator(str(tmp_path / "tensorboard"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("reward/mean")] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]


def _left_running(runs_dir, run_id: str, state: str = "running", **spec) -> Run:
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(spec_to_yaml(RunSpec.model_validate(spec)))
    run = Run(run_id, RunSpec.model_validate(spec), run_dir)
    run.set_state(pb.RUN_STATE_RUNNING)
    run.count_generated(40)
    run.record_step(1, 1, {"reward/mean": 0.5, "batch/trajectories_trained": 8.0})
    if state == "cancelling":
        run.set_state(pb.RUN_STATE_CANCELLING)
    run.save()
    return run


def _manager(tmp_path, body=None, resume_on_restart: bool = True) -> RunManager:
    return RunManager(tmp_path, body, Admission(), preflight_timeout_s=5, resume_on_restart=resume_on_restart)


def test_a_restarted_coordinator_reloads_events_and_resumes_running_runs(tmp_path):
    earlier = _left_running(tmp_path, "r1")
    resumed: list[tuple[str, str]] = []

    async def body(run: Run) -> None:
        resumed.append((run.run_id, run.resume_reason))

    async def scenario() -> RunManager:
        manager = _manager(tmp_path, body, resume_on_restart=True)
        run = manager.get("r1", SYSTEM)
        # What the earlier coordinator announced is there, unchanged, and new events continue the sequence.
        assert [(ev.sequence, ev.kind, ev.message) for ev in run.events[:len(earlier.events)]] == [
            (ev.sequence, ev.kind, ev.message) for ev in earlier.events]
        assert run.ledger.to_dict() == earlier.ledger.to_dict()
        await manager.task("r1")
        return manager

    manager = asyncio.run(scenario())
    run = manager.get("r1", SYSTEM)
    assert resumed == [("r1", "the coordinator restarted while the run was running")]
    assert run.state == pb.RUN_STATE_SUCCEEDED
    assert [ev.sequence for ev in run.events] == list(range(len(run.events)))
    on_disk = [json.loads(line) for line in (tmp_path / "r1" / "events.jsonl").read_text().splitlines()]
    assert [r["seq"] for r in on_disk] == list(range(len(run.events)))


def test_a_reloaded_run_counts_what_its_events_announced_after_run_json_was_saved(tmp_path):
    """A coordinator killed between an event and the next save of run.json (it saves once per step):
    the reloaded ledger and step are those the event log announced, so a rewind undoes the right counts."""
    run = _left_running(tmp_path, "r4")
    run.drop("zero_advantage", 8, "dropped 2 groups")
    run.record_step(2, 2, {"batch/trajectories_trained": 16.0})
    reloaded = Run.from_disk(tmp_path / "r4")
    assert reloaded.ledger.to_dict() == run.ledger.to_dict() == {
        "generated": 40, "scored": 40, "trained": 24, "dropped": {"zero_advantage": 8}}
    assert reloaded.step == 2
    after, changes = reloaded.ledger.rewind(Ledger(16, 16, 8, Counter()))
    assert changes == {"dropped/recovered": 24.0, "dropped/zero_advantage": -8.0, "trained": -16.0}
    assert after.in_flight == 8


def test_usage_sums_the_step_events_and_survives_a_restart(tmp_path):
    """Usage is what the events' usage/* metrics say: shown in the run's proto, saved in run.json, and
    rebuilt from events.jsonl by a restarted coordinator."""
    run = _left_running(tmp_path, "r5")
    spend = {"usage/generated_tokens": 96.0, "usage/trained_tokens": 160.0, "usage/generation_device_s": 1.5,
             "usage/training_device_s": 0.25}
    run.emit(pb.EVENT_KIND_DROPPED, "dropped", {"dropped/stale": 8.0})
    run.emit(pb.EVENT_KIND_VALIDATION, "SFT step 4", spend)  # an SFT warm start's steps
    for step in (1, 2):
        run.emit(pb.EVENT_KIND_STEP, f"step {step}/3", spend, step=step)
    want = {"generated_tokens": 288, "trained_tokens": 480, "generation_device_seconds": 4.5,
            "training_device_seconds": 0.75}
    assert run.usage.to_dict() == want
    run.save()
    assert json.loads((tmp_path / "r5" / "run.json").read_text())["usage"] == want
    (tmp_path / "r5" / "run.json").write_text(json.dumps({**json.loads((tmp_path / "r5" / "run.json").read_text()),
                                                         "usage": {}}))  # events are the record
    reloaded = Run.from_disk(tmp_path / "r5")
    assert reloaded.usage.to_dict() == want
    proto = reloaded.to_proto().usage
    assert (proto.generated_tokens, proto.trained_tokens, proto.generation_device_seconds,
            proto.training_device_seconds) == (288, 480, 4.5, 0.75)


@pytest.mark.parametrize("resume_on_restart, auto_resume", [(False, True), (True, False)])
def test_runs_left_running_fail_with_the_resume_command_when_resuming_is_off(tmp_path, resume_on_restart,
                                                                             auto_resume):
    _left_running(tmp_path, "r2", checkpointing={"auto_resume": auto_resume})
    manager = _manager(tmp_path, resume_on_restart=resume_on_restart)
    run = manager.get("r2", SYSTEM)
    assert run.state == pb.RUN_STATE_FAILED
    assert run.error.startswith("the coordinator stopped while the run was running (")
    assert "rlserve submit --resume r2" in run.error
    assert run.ledger.dropped == Counter({"failed": 32}) and run.ledger.balanced()


def test_a_run_left_cancelling_ends_cancelled_with_its_trajectories_counted(tmp_path):
    _left_running(tmp_path, "r3", state="cancelling")
    run = _manager(tmp_path).get("r3", SYSTEM)
    assert run.state == pb.RUN_STATE_CANCELLED
    assert run.ledger.dropped == Counter({"cancelled": 32}) and run.ledger.balanced()
    assert run.events[-2].kind == pb.EVENT_KIND_DROPPED and run.events[-2].metrics["dropped/cancelled"] == 32


def test_runs_queue_one_at_a_time_and_cancel_goes_through_cancelling(tmp_path):
    started: list[str] = []

    async def body(run: Run) -> None:
        started.append(run.run_id)
        run.count_generated(16)
        await asyncio.sleep(3600)

    async def scenario() -> None:
        manager = _manager(tmp_path, body)
        a = await manager.submit(spec_to_yaml(RunSpec()), "a", resume=False, caller=SYSTEM)
        b = await manager.submit(spec_to_yaml(RunSpec()), "b", resume=False, caller=SYSTEM)
        await asyncio.sleep(0.01)
        assert (a.state, b.state, started) == (pb.RUN_STATE_RUNNING, pb.RUN_STATE_QUEUED, ["a"])
        assert manager.cancel("a", SYSTEM).state == pb.RUN_STATE_CANCELLING
        await asyncio.gather(manager.task("a"), return_exceptions=True)
        assert a.state == pb.RUN_STATE_CANCELLED and a.error == "by CancelRun at step 0"
        assert a.ledger.dropped == Counter({"cancelled": 16}) and a.ledger.balanced()
        await asyncio.sleep(0.01)
        assert b.state == pb.RUN_STATE_RUNNING and started == ["a", "b"]
        await manager.shutdown()  # the coordinator going away leaves b as it is, to be resumed
        assert b.state == pb.RUN_STATE_RUNNING
        assert json.loads((tmp_path / "b" / "run.json").read_text())["state"] == "running"

    asyncio.run(scenario())


def test_a_watch_ends_after_its_lifetime_and_continues_from_the_next_event(tmp_path):
    """An idle WatchRun stream (from a sequence far ahead, or a run that makes no progress) once held a
    coordinator slot for as long as the client kept it open; now it ends after `max_s`."""
    async def main():
        run = Run("w", RunSpec(), tmp_path / "w")
        run.emit(pb.EVENT_KIND_INFO, "one")
        seen = [ev.message async for ev in run.watch(0, max_s=0.05)]
        assert seen == ["one"] and run.state not in TERMINAL
        assert [ev async for ev in run.watch(10**12, max_s=0.05)] == []
        run.emit(pb.EVENT_KIND_INFO, "two")
        run.set_state(pb.RUN_STATE_CANCELLED, "test")
        later = [ev.message async for ev in run.watch(1, max_s=60)]
        assert later[0] == "two" and later[-1].startswith("cancelled")
    asyncio.run(main())


def test_finished_runs_forget_their_events_and_read_them_back(tmp_path):
    run = _left_running(tmp_path, "old")
    run.end(pb.RUN_STATE_SUCCEEDED)
    before = [(ev.sequence, ev.message) for ev in run.events]
    run.forget_events()
    assert run._events is None
    assert [(ev.sequence, ev.message) for ev in run.events] == before  # read back from events.jsonl
    run.emit(pb.EVENT_KIND_INFO, "after")  # sequence numbers continue
    assert run.events[-1].sequence == len(before)
