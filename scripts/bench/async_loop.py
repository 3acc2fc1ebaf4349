"""Async-loop benchmark: the same run synchronous (max age 0), step-level async (one request per
step, updates wait for running requests) and streaming with in-flight weight updates (one request
per prompt, updates land in running requests), at max ages 1 and 2, in one run on one local
cluster. Reports wall-clock per step and trajectories/s as ratios to the synchronous baseline, the
rollout engines' idle fraction, samples spanning versions, and how much of a step went to service
plumbing (RPC, serialization, the object store) rather than compute. Prints a table and writes
bench-results/async_loop.json.

    .venv/bin/python scripts/bench/async_loop.py [--steps 12] [--modes sync async-1 stream-1 ...]
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
    # Separate CPU shares: the learner trains on one thread, the rollout engine (a Serve replica:
    # Ray gives it OMP_NUM_THREADS=1) generates on another, so on 2 cores neither starves the other.
    "cluster": {"torch_threads": 1},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="let every process use every core (default: engine on core 0, the rest on core 1)")
    parser.add_argument("--max-prompts-in-flight", type=int, default=None, help="streaming modes (default: the spec's)")
    parser.add_argument("--prompts-per-request", type=int, default=None, help="streaming modes (default: the spec's)")
    parser.add_argument("--modes", nargs="+", default=["sync", "async-1", "stream-1", "async-2", "stream-2"],
                        help="sync, async-AGE (step-level) or stream-AGE (streaming + in-flight updates)")
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
    if args.pin:
        # Separate CPU shares: the vLLM engine's processes on core 0, everything else (learner,
        # coordinator, reward, the rollout replica that feeds the engine) on core 1.
        for name, svc in data["services"].items():
            svc["cpu_cores"] = [1]
        data["services"]["rollout"]["args"]["cpu_cores"] = [0]
    cluster_file.write_text(yaml.safe_dump(data))
    cluster = Cluster(*load_cluster_file(cluster_file))
    up(cluster)
    rows = []
    try:
        with CoordinatorClient(cluster.grpc_endpoint) as client:
            for mode in args.modes:
                kind, _, age = mode.partition("-")
                if kind not in ("sync", "async", "stream"):
                    parser.error(f"unknown mode {mode!r}")
                stream = kind == "stream"
                spec = json.loads(json.dumps(SPEC))
                spec["grpo"]["max_num_steps"] = args.steps
                spec["policy"]["generation"]["max_new_tokens"] = args.max_new_tokens
                spec["policy"]["max_total_sequence_length"] = args.max_new_tokens + 26
                spec["grpo"]["async_grpo"].update({"max_trajectory_age_steps": int(age or 0), "streaming": stream,
                                                   "in_flight_weight_updates": stream})
                for key in ("max_prompts_in_flight", "prompts_per_request"):
                    if stream and getattr(args, key) is not None:
                        spec["grpo"]["async_grpo"][key] = getattr(args, key)
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
                idle = [m["engine/idle_fraction"] for m in timed if "engine/idle_fraction" in m]
                rows.append({"mode": mode, "step_s": step_s,
                             "trajectories_per_s": 64 * 8 / step_s,
                             "engine_idle": statistics.median(idle) if idle else float("nan"),
                             "completion_tokens_mean": statistics.mean(m["completion/tokens_mean"] for m in timed),
                             "completion_tokens_max": max(m["completion/tokens_max"] for m in timed),
                             "staleness_mean": statistics.mean(m["batch/staleness_mean"] for m in timed),
                             "mixed_samples": statistics.mean(m["batch/mixed_version_samples"] for m in timed),
                             "weight_sync_s": statistics.median(m["timing/weight_sync_s"] for m in timed),
                             "train_s": statistics.median(m["timing/train_s"] for m in timed),
                             "plumbing_s": plumbing, "plumbing_share_of_work": plumbing / compute})
    finally:
        down(cluster)
    base = rows[0]["step_s"]
    for r in rows:
        r["speedup_vs_sync"] = base / r["step_s"]
    print(table(rows, ["mode", "step_s", "speedup_vs_sync", "trajectories_per_s", "engine_idle", "completion_tokens_mean",
                       "completion_tokens_max", "staleness_mean",
                       "mixed_samples", "weight_sync_s", "train_s", "plumbing_s", "plumbing_share_of_work"]))
    print("wrote", record("async_loop", rows, {"steps": args.steps, "prompts": 64, "samples": 8}))


if __name__ == "__main__":
    main()
