"""What an idle default cluster costs, by process, and the training speed beside it, before and after.

For each setting (`--settings before after`, one cluster at a time) the script brings the embedded default
cluster up as `deploy/serve up` does (`python -m rlserve.cluster.cli up FILE`, a separate process, so nothing
of this script is a Ray driver), on ports of its own and a runs directory in a temporary folder; waits
`--wait-s` (60) with nothing submitted; then samples the CPU seconds (user + system, psutil) of every process
of the cluster over `--sample-s` (30): the Ray head's session (`ray start` and everything it spawned: GCS,
raylet, dashboard agent, runtime-env agent, log monitor, the Serve controller, each replica, each actor)
and whatever those started. Then the training speed check on the same cluster: the demo spec
(examples/grpo_addition.yaml without its SFT warm start, sync, `--steps` steps) submitted through the
gateway, the medians of the step time and the weight sync time over the steps after the first two (engine
warm-up). Then `down`.

`before` is the cluster file with the previous settings (`BEFORE`: Ray's and Serve's own defaults for every
key of the cluster file's `ray` section, and the coordinator's run feed looking ten times a second while idle);
`after` is the embedded default as shipped. (The rollout's mailbox poll, 60 s now and 5 s before, is a constant
of `rlserve.rollout.follower`, not a setting: both runs have the new one.)

The machine may be shared: other processes' CPU does not count in the per-process seconds, which stay
meaningful, but it slows the training check; the load average over the sample is recorded beside them.

    .venv/bin/python scripts/bench/idle_cluster.py [--settings before after] [--wait-s 60] [--sample-s 30]
        [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import default_cluster_data, record, table  # noqa: E402
from scripts.bench.curves import merged  # noqa: E402

# The cluster file's keys that give back the settings before issue 45 (Ray's and Serve's own defaults, the
# loops' old intervals), over the embedded default.
BEFORE: dict = {"ray": {"log_monitor": True, "serve_control_loop_interval_s": 0.1, "serve_metrics_export_interval_ms": 100,
                        "metrics_report_interval_ms": 10_000, "dashboard_agent_report_interval_ms": 5000,
                        "num_workers_soft_limit": -1},
                "services": {"coordinator": {"args": {"run_feed_idle_s": 0.1}}}}
COLUMNS = ["setting", "process", "count", "cpu_s", "pct_of_core"]
SPEED_COLUMNS = ["setting", "idle_pct_of_core", "step_s", "weight_sync_s", "train_s", "generate_s", "load_avg_1m"]
PORTS = {"ray_port": 6820, "grpc_port": 9320, "http_port": 9321}


def label(proc) -> str:  # noqa: ANN001 - a psutil.Process
    """A process's role in the cluster, from its title (Ray's workers set `ray::<actor or replica>`)."""
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except Exception:  # noqa: BLE001 - gone or unreadable
        return "?"
    if cmd.startswith("ray::"):
        title = cmd.split()[0][len("ray::"):]
        if title.startswith("ServeReplica:"):
            return "replica " + title.split(":")[1]
        return title.split(".")[0]  # ServeController, Fleet, WeightStore, IDLE, ... (without the method it runs)
    for needle, name in (("gcs_server", "GCS"), ("raylet", "raylet"), ("dashboard/agent.py", "dashboard agent"),
                         ("runtime_env/agent", "runtime-env agent"), ("log_monitor", "log monitor"),
                         ("dashboard/dashboard.py", "dashboard"), ("autoscaler", "autoscaler monitor"),
                         ("monitor.py", "autoscaler monitor"), ("ray.scripts.scripts start", "ray start"),
                         ("spec_reader", "spec reader")):
        if needle in cmd:
            return name
    args = cmd.split()
    return " ".join([Path(args[0]).name, *args[1:3]])[:60]


def cluster_processes(head_pid: int) -> dict[int, object]:
    """pid -> psutil.Process: the head's session and every descendant of it."""
    import psutil

    procs = {}
    try:
        head = psutil.Process(head_pid)
        for p in [head, *head.children(recursive=True)]:
            procs[p.pid] = p
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == head_pid:
                procs[p.pid] = p
        except (ProcessLookupError, PermissionError):
            continue
    return procs


def cpu_seconds(proc) -> float | None:  # noqa: ANN001
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001 - gone
        return None


def sample(head_pid: int, seconds: float) -> tuple[dict[str, dict], float]:
    """Role -> {count, cpu_s} over `seconds`, and the 1-minute load average at the end. A process that started
    during the sample counts from 0; one that ended counts up to its last reading."""
    first = {pid: (p, cpu_seconds(p)) for pid, p in cluster_processes(head_pid).items()}
    labels = {pid: label(p) for pid, (p, _) in first.items()}
    last = {pid: t for pid, (_, t) in first.items()}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        for pid, p in cluster_processes(head_pid).items():
            if pid not in first:
                first[pid] = (p, 0.0)
                labels[pid] = label(p)
            t = cpu_seconds(p)
            if t is not None:
                last[pid] = t
    roles: dict[str, dict] = {}
    for pid, (_, t0) in first.items():
        role = roles.setdefault(labels[pid], {"count": 0, "cpu_s": 0.0})
        role["count"] += 1
        role["cpu_s"] += max(0.0, (last.get(pid) or 0.0) - (t0 or 0.0))
    return roles, os.getloadavg()[0]


def speed_check(endpoint: str, steps: int) -> dict[str, float]:
    """The demo step's medians (after the first two steps) on the running cluster."""
    import yaml

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.v1 import coordinator_pb2 as pb
    from scripts.bench.step_budget import demo_spec

    with CoordinatorClient(endpoint) as client:
        run = client.submit(yaml.safe_dump(demo_spec(steps, 0)))
        metrics = [dict(ev.metrics) for ev in client.watch(run.run_id) if ev.kind == pb.EVENT_KIND_STEP]
        final = client.get(run.run_id)
    if final.state != pb.RUN_STATE_SUCCEEDED:
        raise SystemExit(f"the speed check's run {final.run_id} ended {pb.RunState.Name(final.state)}: {final.error}")
    counted = metrics[2:] or metrics
    med = lambda key: statistics.median(m.get(key, float("nan")) for m in counted)  # noqa: E731
    return {"step_s": med("timing/step_s"), "weight_sync_s": med("timing/weight_sync_s"),
            "train_s": med("timing/train_s"), "generate_s": med("timing/generate_s")}


def serve(action: str, cluster_file: Path, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "rlserve.cluster.cli", action, str(cluster_file)], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, **env})


def measure(setting: str, args: argparse.Namespace) -> tuple[list[dict], dict]:
    import yaml

    from rlserve.cluster.serve_config import state_dir

    root = Path(tempfile.mkdtemp(prefix=f"rlserve-idle-{setting}-"))
    data = merged(default_cluster_data(), BEFORE if setting == "before" else {})
    data.update({**PORTS, "runs_dir": str(root / "runs")})
    cluster_file = root / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(data, sort_keys=False))
    t0 = time.monotonic()
    serve("up", cluster_file, args.env)
    try:
        up_s = time.monotonic() - t0
        head_pid = int((state_dir(root / "runs") / "head.pid").read_text())
        print(f"{setting}: up in {up_s:.0f}s; idle for {args.wait_s:.0f}s, then sampling {args.sample_s:.0f}s",
              flush=True)
        time.sleep(args.wait_s)
        roles, load = sample(head_pid, args.sample_s)
        print(table([{"process": k, **v} for k, v in sorted(roles.items(), key=lambda kv: -kv[1]["cpu_s"])],
                    ["process", "count", "cpu_s"]), flush=True)
        speed = speed_check(f"127.0.0.1:{PORTS['grpc_port']}", args.steps) if args.steps else {}
    finally:
        serve("down", cluster_file, args.env)
    rows = [{"setting": setting, "process": name, "count": r["count"], "cpu_s": r["cpu_s"],
             "pct_of_core": 100 * r["cpu_s"] / args.sample_s}
            for name, r in sorted(roles.items(), key=lambda kv: -kv[1]["cpu_s"])]
    total = sum(r["cpu_s"] for r in rows)
    rows.append({"setting": setting, "process": "TOTAL", "count": sum(r["count"] for r in rows), "cpu_s": total,
                 "pct_of_core": 100 * total / args.sample_s})
    return rows, {"setting": setting, "idle_pct_of_core": 100 * total / args.sample_s, "load_avg_1m": load,
                  "up_s": up_s, **speed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", nargs="+", default=["before", "after"], choices=["before", "after"])
    parser.add_argument("--wait-s", type=float, default=60.0, help="idle time after `up` before sampling")
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=6, help="the speed check's steps (0: none)")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="extra environment for the cluster's processes (to try a setting before it is a key)")
    args = parser.parse_args()
    args.env = dict(kv.split("=", 1) for kv in args.env)
    rows, speeds = [], []
    for setting in args.settings:
        r, s = measure(setting, args)
        rows += r
        speeds.append(s)
        print(table(r, COLUMNS), flush=True)
    print(table(rows, COLUMNS))
    print(table(speeds, SPEED_COLUMNS))
    print("wrote", record("idle_cluster", rows, {"speed": speeds, "wait_s": args.wait_s, "sample_s": args.sample_s,
                                                 "steps": args.steps, "before": BEFORE, "env": args.env,
                                                 "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
