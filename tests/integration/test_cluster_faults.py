"""Faults of the cluster itself, on a cluster of this module's own (`fault_cluster.yaml`: a head and a
second Ray node on loopback that runs the rollout replica): the whole cluster stopped and started under
a running run, and the rollout node lost mid-run."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.cluster.lifecycle import down, kill_node, start_node, up
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.conftest import HERE, is_loopback, listeners_of, running_cluster
from tests.integration.runs_support import TERMINAL, assert_records_agree, events_until_end, metric_rows, spec, wait_for

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fault_cluster(tmp_path_factory):
    with running_cluster(HERE / "fault_cluster.yaml", tmp_path_factory.mktemp("faults")) as cluster:
        yield cluster


def _key(ev: pb.RunEvent) -> tuple:
    return ev.sequence, ev.kind, ev.step, ev.state, ev.message, ev.time_unix


def test_cluster_restart_mid_run_resumes_by_itself(fault_cluster):
    """`down` then `up` at step 2 of 30 (`down` lets the coordinator drain for a few seconds, during
    which the run goes on at a fraction of a second per step): the new coordinator reloads the run with
    its events and resumes it from its checkpoint with no request; GetRun never shows it failed or half
    restored; each step's prompts are those of an uninterrupted run (data cursor (k - 1) x 8 at step k)."""
    steps = 30
    with CoordinatorClient(fault_cluster.endpoint) as client:
        run = client.submit(spec(grpo__max_num_steps=steps, grpo__val_period=10, checkpointing__save_period=2,
                                 grpo__async_grpo={"enabled": True, "max_trajectory_age_steps": 1}))
        seen = []
        for ev in client.watch(run.run_id, timeout_s=300):
            seen.append(ev)
            if ev.kind == pb.EVENT_KIND_STEP and ev.step == 2:
                break
        before = client.get(run.run_id)
    t_down = time.time()
    down(fault_cluster.cluster)
    t_up = time.time()
    up(fault_cluster.cluster)
    snapshots = []
    with CoordinatorClient(fault_cluster.endpoint) as client:
        deadline = time.time() + 300
        while not snapshots or snapshots[-1].state not in TERMINAL:
            assert time.time() < deadline, "the run did not end"
            snapshots.append(client.get(run.run_id))
            time.sleep(0.5)
        events = events_until_end(client, run.run_id, timeout_s=30)
        tail = list(client.watch(run.run_id, from_sequence=len(seen), timeout_s=30))
    final = snapshots[-1]
    assert final.state == pb.RUN_STATE_SUCCEEDED and final.step == steps, final.error
    # Never FAILED, never back at step 0 or with a smaller ledger while it restored.
    assert all(s.state in (pb.RUN_STATE_RUNNING, pb.RUN_STATE_SUCCEEDED) for s in snapshots)
    assert all(s.step >= 2 and s.ledger.generated >= before.ledger.generated for s in snapshots)
    # Events reloaded from disk, sequence numbers continued; WatchRun from a sequence works across it.
    assert [_key(ev) for ev in events[:len(seen)]] == [_key(ev) for ev in seen]
    assert [_key(ev) for ev in tail] == [_key(ev) for ev in events[len(seen):]]
    assert any(ev.kind == pb.EVENT_KIND_INFO and "the coordinator restarted while the run was running" in ev.message
               for ev in tail)
    recovered = [ev for ev in tail if ev.kind == pb.EVENT_KIND_RECOVERED]
    assert len(recovered) == 1 and re.search(r"continued from step_0000\d\d", recovered[0].message)
    cursors = [r["data/cursor"] for r in metric_rows(final) if r["step"] >= 1]
    assert cursors == [8.0 * k for k in range(steps)]
    assert_records_agree(final, events)
    first_step = next(ev for ev in tail if ev.kind == pb.EVENT_KIND_STEP and ev.sequence > recovered[0].sequence)
    print(f"\ncluster restart: down at step 2 took {t_up - t_down:.1f}s; RECOVERED {recovered[0].time_unix - t_up:.1f}s "
          f"after up began, next step after {first_step.time_unix - t_up:.1f}s; steps redone "
          f"{recovered[0].metrics['recovery/steps_redone']:.0f}; dropped as recovered "
          f"{final.ledger.dropped['recovered']}")


def test_losing_the_rollout_node_mid_run_loses_nothing(fault_cluster):
    """The node running the rollout (its one replica) dies (SIGKILL of its raylet and workers) at step 2; a
    replacement joins 10 s later; the replica is rescheduled there, loads the newest published weights,
    and the run finishes with every trajectory trained or dropped for a training reason."""
    with CoordinatorClient(fault_cluster.endpoint) as client:
        run = client.submit(spec(grpo__max_num_steps=6, grpo__val_period=0, checkpointing__enabled=False))
        wait_for(client, run.run_id, pb.EVENT_KIND_STEP, where=lambda ev: ev.step == 2)
        kill_node(fault_cluster.cluster, "rollout-node")
        t_kill = time.time()
        time.sleep(10)
        start_node(fault_cluster.cluster, 0)
        events = events_until_end(client, run.run_id)
        final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_SUCCEEDED and final.step == 6, final.error
    assert not any(ev.kind == pb.EVENT_KIND_RECOVERED for ev in events), "no run state lived on that node"
    assert set(final.ledger.dropped) <= {"zero_advantage"}, final.ledger.dropped
    assert_records_agree(final, events)
    deadline, node_listeners = time.time() + 60, []
    while not node_listeners and time.time() < deadline:  # a listing can miss a process that is starting
        node_listeners = listeners_of(fault_cluster.cluster.state_dir / "node-rollout-node.pid")
        time.sleep(0 if node_listeners else 1)
    assert node_listeners and all(is_loopback(c.laddr.ip) for c in node_listeners), node_listeners
    # Healthy again once the replica runs on the replacement (it may still be starting).
    deadline = time.time() + 180
    while True:
        status = subprocess.run([str(REPO / "deploy" / "serve"), "status", str(fault_cluster.cluster_file)],
                                capture_output=True, text=True, timeout=120)
        if status.returncode == 0 or time.time() > deadline:
            break
        time.sleep(5)
    assert status.returncode == 0 and "node rollout-node: alive" in status.stdout, status.stdout + status.stderr
    after = [ev for ev in events if ev.kind == pb.EVENT_KIND_STEP and ev.time_unix > t_kill]
    retries = [ev for ev in events if ev.kind == pb.EVENT_KIND_RETRY]
    print(f"\nrollout node lost at step 2: {len(retries)} retries, next step {after[0].time_unix - t_kill:.1f}s "
          f"after the kill (replacement node after 10 s); status healthy {time.time() - t_kill:.0f}s after the "
          f"kill; dropped {dict(final.ledger.dropped)}")
