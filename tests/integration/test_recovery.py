"""Runs heal themselves on the shared cluster: a learner worker killed mid-run is recovered from the last
checkpoint with no manual action and ends where an uninterrupted run ends; a reward plug-in that fails for
a while costs the steps it failed on, not the run; a run whose rewards always fail ends FAILED, saying so."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.conftest import plugin
from tests.integration.runs_support import (
    assert_records_agree,
    events_until_end,
    kill_learner_worker,
    metric_events,
    metric_rows,
    spec,
    wait_for,
)

# Sync (on-policy) GRPO with a deterministic backend: a recovered run must end bit-identical to one
# that never failed. 6 steps, checkpoints every 2.
DETERMINISTIC = dict(grpo__max_num_steps=6, grpo__val_period=0, grpo__val_at_start=False,
                     checkpointing__save_period=2, logger__plot_enabled=False)


@pytest.fixture(scope="module")
def client(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as c:
        yield c


def final_weights(run: pb.Run) -> dict[str, torch.Tensor]:
    return load_file(Path(run.final_model_path) / "model.safetensors")


def test_learner_worker_killed_mid_run_recovers_by_itself(client):
    reference = client.submit(spec(**DETERMINISTIC))
    events_until_end(client, reference.run_id)
    reference = client.get(reference.run_id)
    assert reference.state == pb.RUN_STATE_SUCCEEDED, reference.error

    run = client.submit(spec(**DETERMINISTIC))
    wait_for(client, run.run_id, pb.EVENT_KIND_STEP, where=lambda ev: ev.step == 3)  # after the checkpoint at 2
    kill_learner_worker()
    killed_at = time.time()
    events = events_until_end(client, run.run_id)
    final = client.get(run.run_id)

    assert final.state == pb.RUN_STATE_SUCCEEDED, final.error
    recovered = [ev for ev in events if ev.kind == pb.EVENT_KIND_RECOVERED]
    assert len(recovered) == 1 and "continued from step_000002" in recovered[0].message
    assert "learner" in recovered[0].message and "ABORTED" in recovered[0].message
    assert recovered[0].metrics["recovery/steps_redone"] >= 1
    assert final.ledger.dropped["recovered"] > 0
    assert_records_agree(final, events)
    # Each step once in metrics.jsonl (checked above) and in TensorBoard, after the rewind.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(Path(final.run_dir) / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("reward/mean")] == [1, 2, 3, 4, 5, 6]
    # Exact resume: the same prompts per step as the uninterrupted run, and the same final weights
    # (bit-identical: sync GRPO on the CPU dtensor backend is deterministic end to end).
    cursors = [r["data/cursor"] for r in metric_rows(final) if r["step"] >= 1]
    assert cursors == [r["data/cursor"] for r in metric_rows(reference) if r["step"] >= 1] == [8.0 * k for k in range(6)]
    ours, theirs = final_weights(final), final_weights(reference)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "the recovered run's weights differ"
    first_step_after = next(ev for ev in events if ev.kind == pb.EVENT_KIND_STEP and ev.time_unix > recovered[0].time_unix)
    print(f"\nrecovery: learner worker killed at step 3; RECOVERED after {recovered[0].time_unix - killed_at:.1f}s, "
          f"next step after {first_step_after.time_unix - killed_at:.1f}s; steps redone "
          f"{recovered[0].metrics['recovery/steps_redone']:.0f}; dropped as recovered "
          f"{final.ledger.dropped['recovered']}; in flight at the end {final.ledger.in_flight}")




def test_a_reward_plugin_failing_for_two_steps_costs_those_steps_only(client):
    # 8 prompts x 4 samples: items 32..95 are steps 2 and 3 (sync, no validation).
    run = client.submit(spec(grpo__max_num_steps=6, grpo__val_period=0, grpo__val_at_start=False,
                             checkpointing__enabled=False, reward__functions=[{
                                 "name": "outage", "import_path": plugin("outage"),
                                 "args": {"fail_from": 32, "fail_until": 96}}]))
    events = events_until_end(client, run.run_id)
    final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_SUCCEEDED, final.error
    steps = metric_events(events)
    trained = [m["batch/groups_trained"] for m in steps]
    assert trained[1] == trained[2] == 0 and all(trained[i] > 0 for i in (0, 3, 4, 5)), trained
    skipped = [ev for ev in events if ev.kind == pb.EVENT_KIND_WARNING and "skipped" in ev.message]
    assert [ev.message.split()[1] for ev in skipped] == ["2", "3"]
    errors = [ev for ev in events if ev.kind == pb.EVENT_KIND_DROPPED and "reward_error" in ev.message]
    assert len(errors) == 2 and all(ev.metrics["dropped/reward_error"] == 32 for ev in errors)
    # The plug-in's own words reach the user: the first messages, the rest counted.
    assert "RuntimeError: scheduled outage at item 32" in errors[0].message
    assert "29 other messages (29 errors) not shown" in errors[0].message
    assert any(ev.kind == pb.EVENT_KIND_WARNING and "2 of 6 steps trained nothing" in ev.message for ev in events)
    # It learns on: every step after the outage trained and moved the policy one version.
    assert final.weight_version == 4 and all(m["loss/total"] == m["loss/total"] for m in steps[3:])
    assert final.ledger.dropped["reward_error"] == 64
    assert_records_agree(final, events)


def test_a_run_whose_rewards_always_fail_ends_failed_saying_why(client):
    run = client.submit(spec(grpo__max_num_steps=2, grpo__val_period=1, grpo__val_at_start=False,
                             checkpointing__enabled=False,
                             reward__functions=[{"name": "broken", "import_path": plugin("broken")}]))
    events = events_until_end(client, run.run_id)
    final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_FAILED
    assert final.error.startswith("the run trained nothing: all 64 trajectories were dropped (reward_error 64)")
    assert all("ValueError: the grader is broken (x32)" in ev.message for ev in events
               if ev.kind == pb.EVENT_KIND_DROPPED)
    validations = [ev.message for ev in events if ev.kind == pb.EVENT_KIND_VALIDATION]
    assert validations and all(v.startswith("held-out reward unavailable") for v in validations)
    assert_records_agree(final, events)
