"""Async-loop benchmark: the same run synchronous (max age 0), step-level async (one request per
step, updates wait for running requests) and streaming with in-flight weight updates (requests of a
few prompts, updates land in running requests: their KV cache recomputed, or kept), at max ages 1
and 2, side by side in one invocation. Reports wall-clock per step and trajectories/s as ratios to
the synchronous baseline, the rollout engine's idle fraction, completion lengths, samples spanning
versions, and how much of a step went to service plumbing (RPC, serialization, the object store)
rather than compute. Prints a table and writes bench-results/async_loop.json.

Generation and training get separate CPU shares unless --no-pin: the vLLM engine's processes run
on core 0, everything else (learner, coordinator, reward, the rollout replica) on core 1. The
default lengths are RL-shaped: the untrained `tiny` model stops at random, so completions are
long-tailed up to --max-new-tokens (about 38 tokens on average at 64).

    .venv/bin/python scripts/bench/async_loop.py [--steps 10] [--max-new-tokens 64] [--modes sync async-1 ...]
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

from scripts.bench.common import default_cluster_data, record, table  # noqa: E402

SPEC = {
    "name": "bench-async",
    "policy": {"train_micro_batch_size": 256},
    "grpo": {"num_prompts_per_step": 64, "num_generations_per_prompt": 8, "val_period": 0,
             "async_grpo": {"enabled": True}},
    "reward": {"functions": [{"name": "exact_match", "args": {"partial_credit": True}}]},
    "checkpointing": {"enabled": False},
    # One learner thread: on 2 cores, the learner's core (see --no-pin).
    "cluster": {"torch_threads": 1},
}
# kind -> (streaming, in-flight updates, the rollout engine's in_flight_kv_cache)
KINDS = {"sync": (False, False, "recompute"), "async": (False, False, "recompute"),
         "stream": (True, True, "recompute"), "streamkeep": (True, True, "keep")}
COLUMNS = ["mode", "step_s", "speedup_vs_sync", "trajectories_per_s", "trained_per_s", "engine_idle", "engine_paused",
           "completion_tokens_mean",
           "completion_tokens_max", "staleness_mean", "mixed_samples", "weight_sync_s", "train_s", "plumbing_s",
           "plumbing_share_of_work"]


def parse_mode(mode: str) -> tuple[str, int]:
    kind, _, age = mode.partition("-")
    if kind not in KINDS or (kind == "sync") != (age in ("", "0")) or not (age or "0").isdigit():
        raise ValueError(f"unknown mode {mode!r}: sync, async-AGE, stream-AGE or streamkeep-AGE")
    return kind, int(age or 0)


def cluster_data(root: Path, pin: bool, kv_cache: str) -> dict:
    data = default_cluster_data("vllm")  # in-flight updates and pinned engine cores are vLLM's
    data.update({"ray_port": 6780, "grpc_port": 9300, "runs_dir": str(root / "runs")})
    data["services"]["rollout"]["args"]["in_flight_kv_cache"] = kv_cache
    if pin:
        for svc in data["services"].values():
            svc["cpu_cores"] = [1]
        data["services"]["rollout"]["args"]["cpu_cores"] = [0]
    return data


def run_mode(client, mode: str, args: argparse.Namespace) -> dict:
    import yaml

    from rlserve.v1 import coordinator_pb2 as pb

    kind, age = parse_mode(mode)
    stream, in_flight, _ = KINDS[kind]
    spec = json.loads(json.dumps(SPEC))
    spec["grpo"]["max_num_steps"] = args.steps
    spec["policy"]["generation"] = {"max_new_tokens": args.max_new_tokens}
    spec["policy"]["max_total_sequence_length"] = args.max_new_tokens + 26
    spec["grpo"]["async_grpo"].update({"max_trajectory_age_steps": age, "streaming": stream,
                                       "in_flight_weight_updates": in_flight})
    run = client.submit(yaml.safe_dump(spec))
    steps = [dict(ev.metrics) for ev in client.watch(run.run_id) if ev.kind == pb.EVENT_KIND_STEP]
    final = client.get(run.run_id)
    assert final.state == pb.RUN_STATE_SUCCEEDED, final.error
    timed = steps[2:]  # the first steps include engine warm-up
    step_s = statistics.median(m["timing/step_s"] for m in timed)
    compute = statistics.median(sum(m.get(k, 0.0) for k in ("timing/generate_s", "timing/reward_s", "timing/train_s",
                                                              "timing/weight_sync_s")) for m in timed)
    plumbing = statistics.median(sum(v for k, v in m.items() if k.startswith("plumbing/")) for m in timed)
    idle = [m["engine/idle_fraction"] for m in timed if "engine/idle_fraction" in m]
    paused = [m["engine/paused_fraction"] for m in timed if "engine/paused_fraction" in m]
    # Generated and scored per second; trained: those in groups with a signal (the rest are dropped).
    return {"mode": mode, "step_s": step_s, "trajectories_per_s": 64 * 8 / step_s,
            "trained_per_s": sum(m["batch/trajectories_trained"] for m in timed) / sum(m["timing/step_s"] for m in timed),
            "engine_idle": statistics.median(idle) if idle else float("nan"),
            "engine_paused": statistics.median(paused) if paused else float("nan"),
            "completion_tokens_mean": statistics.mean(m["completion/tokens_mean"] for m in timed),
            "completion_tokens_max": max(m["completion/tokens_max"] for m in timed),
            "staleness_mean": statistics.mean(m["batch/staleness_mean"] for m in timed),
            "mixed_samples": statistics.mean(m["batch/mixed_version_samples"] for m in timed),
            "weight_sync_s": statistics.median(m["timing/weight_sync_s"] for m in timed),
            "train_s": statistics.median(m["timing/train_s"] for m in timed),
            "plumbing_s": plumbing, "plumbing_share_of_work": plumbing / compute}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="let every process use every core (default: engine on core 0, the rest on core 1)")
    parser.add_argument("--modes", nargs="+",
                        default=["sync", "async-1", "stream-1", "streamkeep-1", "async-2", "stream-2", "streamkeep-2"],
                        help="sync, async-AGE (step-level), stream-AGE (streaming + in-flight updates, KV "
                             "recomputed) or streamkeep-AGE (KV kept)")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4: the first 2 steps (engine warm-up) are not timed")
    if not args.modes or args.modes[0] != "sync":
        parser.error("the first mode must be sync: the others are reported as ratios to it")
    try:
        [parse_mode(m) for m in args.modes]
    except ValueError as err:
        parser.error(str(err))
    if args.pin and (os.cpu_count() or 1) < 2:
        parser.error("pinning needs 2 cores; pass --no-pin")

    import yaml

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up

    rows: dict[str, dict] = {}
    # One cluster per rollout engine setting (the KV policy is the engine's), modes in the given order.
    for kv_cache in dict.fromkeys(KINDS[parse_mode(m)[0]][2] for m in args.modes):
        root = Path(tempfile.mkdtemp(prefix="rlserve-bench-"))
        cluster_file = root / "cluster.yaml"
        cluster_file.write_text(yaml.safe_dump(cluster_data(root, args.pin, kv_cache)))
        cluster = Cluster(*load_cluster_file(cluster_file))
        up(cluster)
        try:
            with CoordinatorClient(cluster.grpc_endpoint) as client:
                for mode in args.modes:
                    if KINDS[parse_mode(mode)[0]][2] == kv_cache:
                        rows[mode] = run_mode(client, mode, args)
        finally:
            down(cluster)
    ordered = [rows[m] for m in args.modes]
    base = ordered[0]["step_s"]
    for r in ordered:
        r["speedup_vs_sync"] = base / r["step_s"]
    print(table(ordered, COLUMNS))
    print("wrote", record("async_loop", ordered, {"steps": args.steps, "prompts": 64, "samples": 8,
                                                  "max_new_tokens": args.max_new_tokens, "pinned": args.pin}))


if __name__ == "__main__":
    main()
