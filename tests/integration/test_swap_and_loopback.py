"""Swapping the reward service mid-run drops no reward call and shows in the event stream;
nothing the cluster runs listens beyond loopback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import events_until_end, spec, wait_for

REPO = Path(__file__).resolve().parents[2]


def swap(test_cluster, target: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "deploy" / "serve"), "swap", "reward", target, "-c",
                           str(test_cluster.cluster_file)], capture_output=True, text=True, timeout=600)


def test_swap_reward_mid_run(test_cluster, tmp_path):
    plugin = tmp_path / "shorter_is_better.py"
    plugin.write_text("def reward(item):\n    return 1.0 / (1 + len(item.completion))\n")
    with CoordinatorClient(test_cluster.endpoint) as client:
        # No reward.functions: the run scores with whatever the reward service runs (partial-credit
        # exact match in the test cluster, so that steps really train and take time).
        run = client.submit(spec(reward__functions=None, grpo__max_num_steps=40, grpo__val_period=0,
                                 checkpointing__enabled=False))
        wait_for(client, run.run_id, pb.EVENT_KIND_STEP)
        try:
            out = swap(test_cluster, str(plugin))
            assert out.returncode == 0, out.stderr
            assert "reward now runs" in out.stdout
            events = events_until_end(client, run.run_id)
        finally:
            assert swap(test_cluster, "rlserve.rewards.builtins:ExactMatch").returncode == 0
        run = client.get(run.run_id)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    swaps = [ev for ev in events if ev.kind == pb.EVENT_KIND_REWARD_SWAP]
    assert swaps and swaps[0].step < 40, "the swap should land while the run goes on"
    assert not [ev for ev in events if ev.kind == pb.EVENT_KIND_RETRY], "a reward call failed during the swap"
    assert "reward_error" not in run.ledger.dropped
    assert run.ledger.in_flight == 0


def test_nothing_listens_beyond_loopback(test_cluster):
    head = int((test_cluster.cluster.state_dir / "head.pid").read_text())
    pgid = os.getpgid(head)
    ours = {p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid} | {os.getpid()}
    listeners = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert len(listeners) > 5, "expected Ray, Serve and replica listeners"
    wide = [(c.laddr, " ".join(psutil.Process(c.pid).cmdline())[:300]) for c in listeners
            if c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not wide, f"listening beyond loopback: {wide}"


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None
