"""Swapping the reward service mid-run drops no reward call and shows in the event stream;
nothing the cluster runs listens beyond loopback."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import psutil

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import reward_pb2, reward_pb2_grpc
from tests.integration.conftest import is_loopback, listeners_of
from tests.integration.runs_support import assert_records_agree, events_until_end, spec, wait_for

REPO = Path(__file__).resolve().parents[2]


def swap(test_cluster, target: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "deploy" / "serve"), "swap", "reward", target, "-c",
                           str(test_cluster.cluster_file)], capture_output=True, text=True, timeout=600)


def reward_version(channel) -> str:
    stub = reward_pb2_grpc.RewardStub(channel)
    return stub.Score(reward_pb2.ScoreRequest(), timeout=30).reward_version


def test_swap_reward_mid_run(test_cluster, channel, tmp_path):
    """The run keeps training through the swap and after it; it is cancelled only once steps scored by
    the new reward have trained, so how long the swap takes on a loaded machine cannot decide the test."""
    plugin = tmp_path / "shorter_is_better.py"
    plugin.write_text("def reward(item):\n    return 1.0 / (1 + len(item.completion))\n")
    deployed = reward_version(channel)
    with CoordinatorClient(test_cluster.endpoint) as client:
        # No reward.functions: the run scores with whatever the reward service runs (partial-credit
        # exact match in the test cluster, so that steps really train and take time).
        run = client.submit(spec(reward__functions=None, grpo__max_num_steps=100_000, grpo__val_period=0,
                                 checkpointing__enabled=False))
        wait_for(client, run.run_id, pb.EVENT_KIND_STEP)
        try:
            out = swap(test_cluster, str(plugin))
            assert out.returncode == 0, out.stderr
            assert "reward now runs" in out.stdout
            landed = wait_for(client, run.run_id, pb.EVENT_KIND_REWARD_SWAP)
            wait_for(client, run.run_id, pb.EVENT_KIND_STEP, where=lambda ev: ev.step >= landed.step + 2)
            client.cancel(run.run_id)
            events = events_until_end(client, run.run_id)
        finally:
            assert swap(test_cluster, "default").returncode == 0
        run = client.get(run.run_id)
    # Restored exactly as the cluster file deploys it (partial credit included), not a look-alike.
    assert reward_version(channel) == deployed
    assert run.state == pb.RUN_STATE_CANCELLED and run.error.startswith("by CancelRun"), run.error
    swaps = [ev for ev in events if ev.kind == pb.EVENT_KIND_REWARD_SWAP]
    assert swaps and swaps[0].step < run.step, "the swap should land while the run goes on"
    assert not [ev for ev in events if ev.kind == pb.EVENT_KIND_RETRY], "a reward call failed during the swap"
    assert "reward_error" not in run.ledger.dropped
    assert_records_agree(run, events)


def test_nothing_listens_beyond_loopback(test_cluster):
    listeners = listeners_of(test_cluster.cluster.state_dir / "head.pid", include_this_process=True)
    assert len(listeners) > 5, "expected Ray, Serve and replica listeners"
    wide = [(c.laddr, " ".join(psutil.Process(c.pid).cmdline())[:300]) for c in listeners
            if not is_loopback(c.laddr.ip)]
    assert not wide, f"listening beyond loopback: {wide}"


def test_compute_services_run_below_the_control_plane(test_cluster):
    """Rollout, reference and learner replicas run niced (10 by default), so a caller's GetRun is served
    ahead of training on a machine whose cores training fills; coordinator, reward and gateway do not."""
    pgid = os.getpgid(int((test_cluster.cluster.state_dir / "head.pid").read_text()))
    head = set()  # this cluster's raylet and GCS; its workers are the raylet's children (in groups of their own)
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid:
                head.add(p.pid)
    nice = {}
    for p in psutil.process_iter(["cmdline", "ppid"]):
        title = (p.info["cmdline"] or [""])[0]
        with contextlib.suppress(psutil.Error):
            if title.startswith("ray::ServeReplica:") and p.info["ppid"] in head:
                nice[title.split(":")[3]] = p.nice()
    assert set(nice) >= {"rollout", "reference", "learner", "coordinator", "reward", "gateway"}, nice
    assert all(nice[app] >= 10 for app in ("rollout", "reference", "learner")), nice
    assert all(nice[app] < 10 for app in ("coordinator", "reward", "gateway")), nice
