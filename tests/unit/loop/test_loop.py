"""Whole runs of the GRPO loop against the in-memory services: synchronous and async runs train every
step with a balanced ledger, a lost learner session heals from the last checkpoint, two runs share
nothing, and a KL penalty brings in the reference."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from rlserve.loop.inputs import LoopSettings
from rlserve.loop.recovery import RecoveryBudget, run_to_end
from rlserve.runs.ledger import Ledger
from rlserve.runs.record import Run
from rlserve.trajectories.metrics import engine_idle
from rlserve.v1 import coordinator_pb2 as pb
from tests.support.fake_services import FakeServices

SETTINGS = LoopSettings(weight_store="fake", watchdog_timeout_s=60)


def kinds(run: Run) -> list[str]:
    return [pb.EventKind.Name(ev.kind).removeprefix("EVENT_KIND_").lower() for ev in run.events]


def test_a_synchronous_run_trains_every_step_with_a_balanced_ledger(make_run):
    run, _ = make_run()
    services = FakeServices()
    asyncio.run(run_to_end(run, services, SETTINGS))
    steps = 4
    assert run.step == steps and run.version == services.learner_version == services.served
    assert run.ledger.balanced() and run.ledger.trained == sum(n for _, n in services.calls.train)
    assert run.ledger.generated == steps * 16
    # On-policy: every step's groups come from the weights of the step before.
    assert [req.min_weight_version for req in services.calls.generate if req.num_samples > 1] == list(range(steps))
    rows = run.recorder.read("metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and "val/reward" in rows[-1]
    assert all(r["batch/staleness_max"] == 0 for r in rows[1:])
    assert kinds(run).count("step") == steps and kinds(run).count("checkpoint") == 1  # step 2 (not the last)
    assert (run.run_dir / "final_model" / "config.json").is_file()
    assert services.calls.released == ["r"] and services.session is None  # the workers' CPUs are free again
    # What the events announced adds up to the ledger (a restarted coordinator rebuilds it from them).
    assert Ledger(run.ledger.generated, run.ledger.scored).as_announced(run.events).to_dict() == run.ledger.to_dict()


def test_an_async_streaming_run_trains_stale_by_at_most_the_bound(make_run):
    run, _ = make_run(grpo={"max_num_steps": 5, "async_grpo": {"enabled": True, "max_trajectory_age_steps": 1,
                                                               "streaming": True, "prompts_per_request": 2}})
    services = FakeServices(generate_delay_s=0.01)
    asyncio.run(run_to_end(run, services, SETTINGS))
    rows = run.recorder.read("metrics.jsonl")[1:]
    assert run.step == 5 and run.ledger.balanced() and run.ledger.dropped.get("stale", 0) == 0
    assert max(r["batch/staleness_max"] for r in rows) == 1  # generation ran one version ahead


@pytest.mark.parametrize("shared, staleness", [(True, 0), (False, 1)])
def test_async_auto_runs_sync_where_generation_and_training_share_cpu_cores(make_run, shared, staleness):
    run, _ = make_run(grpo={"max_num_steps": 4, "async_grpo": {"enabled": "auto", "max_trajectory_age_steps": 1,
                                                               "streaming": True, "prompts_per_request": 2}})
    settings = LoopSettings(weight_store="fake", watchdog_timeout_s=60, generation_shares_cpu_cores=shared)
    asyncio.run(run_to_end(run, FakeServices(generate_delay_s=0.01), settings))
    rows = run.recorder.read("metrics.jsonl")[1:]
    # Sync never trains a stale token; async may, within its bound (whether it does is the scheduler's timing).
    assert run.step == 4 and max(r["batch/staleness_max"] for r in rows) <= staleness
    chosen = "sync, generation and training share the CPU cores" if shared else "async, max trajectory age 1"
    assert [ev.message for ev in run.events if ev.message.startswith("async_grpo.enabled auto")] == [
        f"async_grpo.enabled auto: {chosen}"]


def test_a_lost_learner_session_is_restored_from_the_last_checkpoint(make_run):
    run, _ = make_run()
    services = FakeServices(lose_state_at_version=3)  # the worker dies in step 4, after the step-2 checkpoint
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert run.step == 4 and run.ledger.balanced()
    recovered = [ev for ev in run.events if ev.kind == pb.EVENT_KIND_RECOVERED]
    assert len(recovered) == 1 and "continued from step_000002" in recovered[0].message
    assert recovered[0].metrics["recovery/steps_redone"] == 1
    assert run.ledger.dropped["recovered"] > 0 and services.calls.configure == 2
    # The redone steps train the same prompts an uninterrupted run would have.
    cursors = [r["data/cursor"] for r in run.recorder.read("metrics.jsonl")[1:]]
    assert cursors == [0, 4, 8, 12]
    assert json.loads((run.run_dir / "run.json").read_text())["step"] == 4


def test_an_async_run_restored_while_it_generated_ahead_trains_the_prompts_an_uninterrupted_one_would(make_run):
    """The producer commits the next step while the learner saves a checkpoint: the checkpoint's data cursor,
    queue and ledger are taken together after the save, so the restored run neither repeats nor skips
    prompts (its cursor once stayed at the checkpointed step's while the queue held the next)."""
    run, _ = make_run(grpo={"async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}})
    services = FakeServices(save_delay_s=0.05, lose_state_at_version=3)
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert run.step == 4 and run.ledger.balanced()
    recovered = next(ev for ev in run.events if ev.kind == pb.EVENT_KIND_RECOVERED)
    buffered, cursor = re.search(r"(\d+) buffered groups, data cursor (\d+)", recovered.message).groups()
    assert int(cursor) == 4 * 2 + int(buffered) > 8  # the checkpoint's 2 steps' prompts, then the queued ones'
    assert [r["data/cursor"] for r in run.recorder.read("metrics.jsonl")[1:]] == [0, 4, 8, 12]


def test_two_runs_at_once_share_nothing(make_run):
    (a, _), (b, _) = make_run("a"), make_run("b", grpo={"max_num_steps": 2})
    services_a, services_b = FakeServices(generate_delay_s=0.01), FakeServices(generate_delay_s=0.01)

    async def both():
        await asyncio.gather(run_to_end(a, services_a, SETTINGS), run_to_end(b, services_b, SETTINGS))

    asyncio.run(both())
    assert (a.step, b.step) == (4, 2) and a.ledger.balanced() and b.ledger.balanced()
    assert a.ledger.generated == 4 * 16 and b.ledger.generated == 2 * 16
    assert {ev.run_id for ev in a.events} == {"a"} and {ev.run_id for ev in b.events} == {"b"}


def test_a_kl_penalty_asks_the_reference_for_every_step(make_run):
    run, _ = make_run(loss_fn={"reference_policy_kl_penalty": 0.1})
    services = FakeServices()
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert services.calls.reference == 4 and run.ledger.balanced()


def test_recovery_budget_counts_recoveries_in_a_row():
    budget = RecoveryBudget(2)
    assert budget.spend() and budget.spend() and not budget.spend()
    budget.refill()
    assert budget.spend()


def test_engine_idle_fraction_counts_replicas_seen_at_both_marks():
    assert engine_idle({"a": (10.0, 2.0, 1.0, 0.0)}, {}) == {}  # nothing to compare with yet
    seen, before = {"a": (20.0, 3.0, 1.5, 500.0), "b": (5.0, 5.0, 0.0, 0.0)}, {"a": (10.0, 2.0, 1.0, 100.0)}
    assert engine_idle(seen, before) == {
        "engine/idle_fraction": 0.1, "engine/paused_fraction": 0.05,
        "usage/generation_device_s": 9.0}  # b is new; busy = 10 s up - 1 s idle
    # A run sharing the engines is charged its token share: 100 of the 400 tokens generated meanwhile.
    assert engine_idle(seen, before, own_tokens=100.0)["usage/generation_device_s"] == 2.25


@pytest.mark.parametrize("cluster, field", [
    ({"num_workers": 1024, "cpus_per_worker": 1}, "cluster.num_workers x cluster.cpus_per_worker"),
    ({"num_workers": 2, "gpus_per_worker": 1}, "cluster.num_workers x cluster.gpus_per_worker"),
    ({"torch_threads": 64}, "cluster.torch_threads"),
])
def test_learner_workers_that_cannot_fit_the_cluster_are_refused(cluster, field):
    from rlserve.config import RunSpec
    from rlserve.loop.admission import RunAdmission
    from rlserve.loop.services import Capacity
    from rlserve.rpc import RpcError

    with pytest.raises(RpcError) as err:
        RunAdmission._check_resources(RunSpec.model_validate({"cluster": cluster}), Capacity(8.0, 0.0, 4.0))
    assert err.value.code.name == "FAILED_PRECONDITION" and err.value.message.startswith(field)
