"""Async-loop benchmark: the same run with grpo.async_grpo.max_trajectory_age_steps 0 vs 1 vs 2,
in one run on one local cluster. Reports wall-clock per step and trajectories/s as ratios to the
synchronous baseline, and how much of a step went to service plumbing (RPC, serialization, the
object store) rather than compute. Prints a table and writes bench-results/async_loop.json.

    .venv/bin/python scripts/bench/async_loop.py [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.common import record, table  # noqa: E402

SPEC = {
    "name": "bench-async",
    "policy": {"max_total_sequence_length": 32, "train_micro_batch_size": 256, "generation": {"max_new_tokens": 6}},
    "grpo": {"num_prompts_per_step": 64, "num_generations_per_prompt": 8, "val_period": 0,
             "async_grpo": {"enabled": True}},
    "reward": {"functions": [{"name": "exact_match", "args": {"partial_credit": True}}]},
    "checkpointing": {"enabled": False},
    "cluster": {"torch_threads": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ages", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4: the first 2 steps (engine warm-up) are not timed")

    import yaml

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.cluster.config import default_cluster_file, load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up
    from rlserve.v1 import coordinator_pb2 as pb

    root = Path(tempfile.mkdtemp(prefix="rlserve-bench-"))
    cluster_file = root / "cluster.yaml"
    data = yaml.safe_load(default_cluster_file().read_text())
    data.update({"ray_port": 6780, "grpc_port": 9300, "runs_dir": str(root / "runs")})
    cluster_file.write_text(yaml.safe_dump(data))
    cluster = Cluster(*load_cluster_file(cluster_file))
    up(cluster)
    rows = []
    try:
        with CoordinatorClient(cluster.grpc_endpoint) as client:
            for age in args.ages:
                spec = json.loads(json.dumps(SPEC))
                spec["grpo"]["max_num_steps"] = args.steps
                spec["grpo"]["async_grpo"]["max_trajectory_age_steps"] = age
                run = client.submit(yaml.safe_dump(spec))
                steps = [dict(ev.metrics) for ev in client.watch(run.run_id) if ev.kind == pb.EVENT_KIND_STEP]
                final = client.get(run.run_id)
                assert final.state == pb.RUN_STATE_SUCCEEDED, final.error
                timed = steps[2:]  # the first steps include engine warm-up
                step_s = statistics.median(m["timing/step_s"] for m in timed)
                compute = statistics.median(
                    sum(m.get(k, 0.0) for k in ("timing/generate_s", "timing/reward_s", "timing/train_s",
                                                "timing/weight_sync_s")) for m in timed)
                plumbing = statistics.median(sum(v for k, v in m.items() if k.startswith("plumbing/")) for m in timed)
                rows.append({"max_age": age, "step_s": step_s,
                             "trajectories_per_s": 64 * 8 / step_s,
                             "staleness_mean": statistics.mean(m["batch/staleness_mean"] for m in timed),
                             "generate_s": statistics.median(m["timing/generate_s"] for m in timed),
                             "train_s": statistics.median(m["timing/train_s"] for m in timed),
                             "plumbing_s": plumbing, "plumbing_share_of_work": plumbing / compute})
    finally:
        down(cluster)
    base = rows[0]["step_s"]
    for r in rows:
        r["speedup_vs_sync"] = base / r["step_s"]
    print(table(rows, ["max_age", "step_s", "speedup_vs_sync", "trajectories_per_s", "staleness_mean",
                       "generate_s", "train_s", "plumbing_s", "plumbing_share_of_work"]))
    print("wrote", record("async_loop", rows, {"steps": args.steps, "prompts": 64, "samples": 8}))


if __name__ == "__main__":
    main()
