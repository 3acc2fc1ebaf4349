"""The run manager without a cluster: preflight before the queue moves, run ids as folder names,
confined resume, and run records that cannot break ListRuns."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import yaml

from rlserve.rpc import RpcError, invalid_argument
from rlserve.runs.manager import Admission, RunManager
from rlserve.runs.record import TERMINAL
from rlserve.security.principal import SYSTEM
from rlserve.tenancy.live import LiveTenancy
from rlserve.tenancy.policy import TenancyPolicy
from rlserve.v1 import coordinator_pb2 as pb

SPEC = yaml.safe_dump({"name": "unit", "grpo": {"max_num_steps": 2}, "logger": {"tensorboard_enabled": False}})


class RefuseByName(Admission):
    """Passes every spec except those named `refused` (their preflight fails), once `go` is set."""

    def __init__(self, refused: str | None):
        self.refused = refused
        self.go = asyncio.Event()
        self.go.set()

    async def preflight(self, spec):
        await self.go.wait()
        if self.refused and spec.name == self.refused:
            raise invalid_argument("policy.model_name", "not this one")


def manager(tmp_path, preflight_error: str | None = None, trained: list | None = None) -> RunManager:
    async def body(run):
        run.record_step(run.spec.max_num_steps, 0, {"batch/trajectories_trained": 0.0})
        (trained if trained is not None else []).append(run.run_id)

    return RunManager(tmp_path, body, RefuseByName(preflight_error), preflight_timeout_s=5)


async def until_done(m: RunManager, run_id: str) -> pb.Run:
    for _ in range(200):
        if m.get(run_id, SYSTEM).state in TERMINAL:
            return m.get(run_id, SYSTEM).to_proto()
        await asyncio.sleep(0.01)
    raise AssertionError(f"{run_id} did not end: {m.get(run_id, SYSTEM).to_proto()}")


def test_runs_start_after_their_preflight_and_a_failed_one_does_not_block_the_queue(tmp_path):
    async def main():
        trained = []
        m = manager(tmp_path, preflight_error="bad", trained=trained)
        m.admission.go.clear()  # both preflights wait until both runs are queued
        bad = await m.submit(SPEC.replace("name: unit", "name: bad"), "first", False, SYSTEM)
        good = await m.submit(SPEC, "second", False, SYSTEM)
        assert bad.state == good.state == pb.RUN_STATE_QUEUED
        m.admission.go.set()
        failed, done = await until_done(m, "first"), await until_done(m, "second")
        assert failed.state == pb.RUN_STATE_FAILED and failed.error.startswith("preflight: INVALID_ARGUMENT: "
                                                                                 "policy.model_name")
        assert done.state == pb.RUN_STATE_SUCCEEDED and trained == ["second"]
    asyncio.run(main())


@pytest.mark.parametrize("run_id", ["../escape", "/abs", ".cluster", "a/b", "x" * 129, "tab\there"])
def test_run_ids_are_folder_names_for_new_and_resumed_runs(tmp_path, run_id):
    async def main():
        m = manager(tmp_path / "runs")
        for resume in (False, True):
            with pytest.raises(RpcError) as err:
                await m.submit(SPEC, run_id, resume, SYSTEM)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.message.startswith("run_id:")
    asyncio.run(main())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_finished_runs_resume_only_to_extend_them(tmp_path):
    async def main():
        m = manager(tmp_path)
        await m.submit(SPEC, "r", False, SYSTEM)
        assert (await until_done(m, "r")).step == 2
        for spec_yaml in ("", SPEC):
            with pytest.raises(RpcError) as err:
                await m.submit(spec_yaml, "r", True, SYSTEM)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(RpcError) as err:
            await m.submit(SPEC.replace("name: unit", "name: other").replace("max_num_steps: 2", "max_num_steps: 3"),
                           "r", True, SYSTEM)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "only grpo.max_num_steps" in err.value.message
        await m.submit(SPEC.replace("max_num_steps: 2", "max_num_steps: 3"), "r", True, SYSTEM)
        final = await until_done(m, "r")
        assert final.state == pb.RUN_STATE_SUCCEEDED and final.step == final.max_steps == 3
    asyncio.run(main())


def test_records_that_do_not_fit_the_api_are_skipped_not_fatal(tmp_path):
    async def main():
        m = manager(tmp_path)
        await m.submit(SPEC, "fine", False, SYSTEM)
        await until_done(m, "fine")
    asyncio.run(main())
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "spec.yaml").write_text(SPEC)
    info = json.loads((tmp_path / "fine" / "run.json").read_text())
    (huge / "run.json").write_text(json.dumps({**info, "run_id": "huge", "step": 2**70}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "run.json").write_text("{not json")
    again = manager(tmp_path)
    assert [r.run_id for r in again.list_protos(SYSTEM)] == ["fine"]


def test_a_run_cancelled_before_its_task_starts_ends_cancelled(tmp_path):
    """CancelRun right after the run started (its task created, not yet run) once left it CANCELLING for
    good and held the queue behind it."""
    async def main():
        m = manager(tmp_path)
        m.admission.go.clear()
        first = await m.submit(SPEC, "first", False, SYSTEM)
        second = await m.submit(SPEC, "second", False, SYSTEM)
        started = first.set_state

        def set_state(state, *args, **kwargs):
            started(state, *args, **kwargs)
            if state == pb.RUN_STATE_RUNNING:
                # Queued before the task's first step (create_task follows set_state): the cancel lands
                # after the task exists and before it runs, whatever the event loop's timing.
                asyncio.get_running_loop().call_soon(m.cancel, "first", SYSTEM)

        first.set_state = set_state
        m.admission.go.set()
        assert (await until_done(m, "first")).state == pb.RUN_STATE_CANCELLED
        assert (await until_done(m, "second")).state == pb.RUN_STATE_SUCCEEDED
        assert first.ledger.balanced() and second.ledger.balanced()
    asyncio.run(main())


def test_a_cancelled_run_whose_task_does_not_stop_is_cancelled_within_the_grace_and_the_queue_moves_on(tmp_path):
    """A run's task still winding down after CancelRun (a learner that does not answer ReleaseSession)
    once left the run CANCELLING, and the queue behind it, for as long as that took."""
    release = asyncio.Event()
    started = asyncio.Event()

    async def body(run):
        if run.run_id == "stuck":
            run.count_generated(8)
            started.set()
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.shield(release.wait())  # as run_to_end's release of the learner

    async def main():
        m = RunManager(tmp_path, body, RefuseByName(None), preflight_timeout_s=5, cancel_grace_s=0.2)
        stuck = await m.submit(SPEC, "stuck", False, SYSTEM)
        await m.submit(SPEC, "next", False, SYSTEM)
        await started.wait()
        m.cancel("stuck", SYSTEM)
        assert stuck.state == pb.RUN_STATE_CANCELLING
        run = await until_done(m, "stuck")
        assert run.state == pb.RUN_STATE_CANCELLED and "did not stop within 0.2s" in run.error
        assert stuck.ledger.in_flight == 0 and stuck.ledger.dropped["cancelled"] == 8
        assert (await until_done(m, "next")).state == pb.RUN_STATE_SUCCEEDED
        events = len(stuck.events)
        release.set()
        await asyncio.sleep(0.05)
        assert stuck.state == pb.RUN_STATE_CANCELLED and len(stuck.events) == events, "ended once"
    asyncio.run(main())


@pytest.mark.parametrize("seed", range(5))
def test_random_submits_cancels_and_resumes_all_end_with_balanced_ledgers(tmp_path, seed):
    """Runs whose bodies take random times, with cancels and resumes fired at random moments: every run
    reaches a final state within a bound, and every ledger balances."""
    import random

    rng = random.Random(seed)

    async def body(run):
        run.count_generated(8)
        await asyncio.sleep(rng.uniform(0, 0.01))
        run.record_step(run.spec.max_num_steps, 0, {"batch/trajectories_trained": 8.0})

    async def main():
        m = RunManager(tmp_path, body, RefuseByName(None), preflight_timeout_s=5)
        ids = [f"r{i}" for i in range(20)]
        for run_id in ids:
            await m.submit(SPEC, run_id, False, SYSTEM)
            for _ in range(rng.randint(0, 3)):
                target = rng.choice(ids[:ids.index(run_id) + 1])
                action = rng.choice(["cancel", "resume", "wait"])
                if action == "cancel":
                    m.cancel(target, SYSTEM)
                elif action == "resume" and m.get(target, SYSTEM).state in TERMINAL:
                    try:
                        await m.submit(SPEC.replace("max_num_steps: 2", "max_num_steps: 3"), target, True, SYSTEM)
                    except RpcError:
                        pass  # a finished run may be resumed only to extend it once
                await asyncio.sleep(rng.uniform(0, 0.005))
        for run_id in ids:
            run = await until_done(m, run_id)
            assert run.state in TERMINAL and run.ledger.in_flight == 0, run
    asyncio.run(main())


def test_the_queue_is_bounded(tmp_path):
    class Slow(Admission):
        def __init__(self):
            self.go = asyncio.Event()

        async def preflight(self, spec):
            await self.go.wait()

    async def main():
        admission = Slow()
        m = RunManager(tmp_path, lambda run: asyncio.sleep(0), admission, preflight_timeout_s=30,
                       tenancy=LiveTenancy(TenancyPolicy.model_validate({"cluster": {"queue_capacity": 2}})))
        await m.submit(SPEC, "a", False, SYSTEM)
        await m.submit(SPEC, "b", False, SYSTEM)
        with pytest.raises(RpcError) as err:
            await m.submit(SPEC, "c", False, SYSTEM)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.message == (
            "2 runs are queued already, the most this cluster holds (tenancy.cluster.queue_capacity); submit when "
            "some have started")
        admission.go.set()
        assert (await until_done(m, "b")).state == pb.RUN_STATE_SUCCEEDED
        await m.submit(SPEC, "c", False, SYSTEM)  # room again
        assert (await until_done(m, "c")).state == pb.RUN_STATE_SUCCEEDED
    asyncio.run(main())


def test_a_paused_run_holds_no_slot_and_resumes_without_extending_it_under_another_guard(tmp_path):
    """The consistency guard's pause: PAUSED with the reason as its error, terminal for watchers and quotas,
    and a resume continues it (its guard may change, nothing else but the steps)."""
    from rlserve.runs.record import RunPaused

    async def main():
        calls = []

        async def body(run):
            calls.append(run.spec.loss_fn.mismatch_guard.action)
            if len(calls) == 1:
                raise RunPaused("loss_fn.mismatch_guard: step 1: too far")
            run.record_step(run.spec.max_num_steps, 0, {"batch/trajectories_trained": 0.0})

        m = RunManager(tmp_path, body, RefuseByName(None), preflight_timeout_s=5)
        await m.submit(SPEC.replace("name: unit", "name: unit\nloss_fn: {mismatch_guard: {action: pause}}"), "p",
                       False, SYSTEM)
        paused = await until_done(m, "p")
        assert paused.state == pb.RUN_STATE_PAUSED and paused.error == "loss_fn.mismatch_guard: step 1: too far"
        with pytest.raises(RpcError) as err:
            await m.submit(SPEC.replace("name: unit", "name: other"), "p", True, SYSTEM)
        assert "only grpo.max_num_steps and loss_fn.mismatch_guard may change" in err.value.message
        await m.submit(SPEC.replace("name: unit", "name: unit\nloss_fn: {mismatch_guard: {action: warn}}"), "p",
                       True, SYSTEM)
        assert (await until_done(m, "p")).state == pb.RUN_STATE_SUCCEEDED and calls == ["pause", "warn"]
    asyncio.run(main())
