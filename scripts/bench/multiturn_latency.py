"""Multi-turn episodes against a slow environment: does the engine idle while episodes wait on it?

The guess-number game (`examples/grpo_guess_number.yaml`), started from that example's SFT warm start
(run once here: it teaches the answer's format, a number and the turn's end, so that episodes go on
turn after turn; the untrained model's turns are cut at their token cap and end the episode at its
first turn), with every Reset and Step delayed by 0, 50 and 200 ms (`scripts/bench/envs/slow_guess.py`),
synchronous and async (max age 1), side by side in one invocation on one local cluster. Per mode, the
medians over the steps after the first (engine warm-up) of: step seconds, trajectories/s, the rollout
engine's idle share of the step (`engine/idle_fraction`: no request in the engine), mean turns per
episode, and the slow-down against the same mode with no latency.

Each prompt's episodes advance on their own: while one waits on its environment, the engine generates
the next turns of the others (`env.max_concurrent_episodes`), so latency shows as idle only when
every episode waits at once.

    .venv/bin/python scripts/bench/multiturn_latency.py [--steps 6] [--latencies-ms 0 50 200] [--modes sync async-1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import default_cluster_data, record, sync_or_async_ages, table  # noqa: E402
from scripts.bench.curves import load_example, watch  # noqa: E402

PLUGIN = f"{ROOT / 'scripts' / 'bench' / 'envs' / 'slow_guess.py'}:SlowGuessNumber"
COLUMNS = ["mode", "latency_ms", "step_s", "trajectories_per_s", "engine_idle", "turns_mean", "env_calls_per_step",
           "slowdown_vs_0ms"]


def guess_game() -> dict:
    """The example with the workload measured in BENCHMARKS.md, 32 prompts a step (the example itself
    takes 16, to learn in more steps of the same time)."""
    data = load_example("grpo_guess_number.yaml")
    data["policy"].update({"train_global_batch_size": 256, "train_micro_batch_size": 256})
    data["grpo"]["num_prompts_per_step"] = 32
    return data


def warm_start_spec() -> dict:
    """The example's SFT warm start and one GRPO step (a run must train): its `sft_model/` is the start."""
    data = guess_game()
    data["name"] = "bench-multiturn-warm-start"
    data["grpo"].update({"max_num_steps": 1, "val_period": 0})
    data["checkpointing"] = {"enabled": False}
    return data


def spec(steps: int, age: int, latency_ms: float, start: Path) -> dict:
    data = guess_game()
    data["name"] = "bench-multiturn-latency"
    data["sft"] = {"enabled": False}
    data["policy"]["model_name"] = str(start)
    data["grpo"].update({"max_num_steps": steps, "val_period": 0, "skip_zero_advantage_groups": False,
                         "async_grpo": {"enabled": age > 0, "max_trajectory_age_steps": max(age, 1)}})
    data["env"].update({"name": "slow_guess", "import_path": PLUGIN,
                        "args": {**data["env"]["args"], "latency_s": latency_ms / 1000}})
    data["checkpointing"] = {"enabled": False}
    return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--latencies-ms", type=float, nargs="+", default=[0.0, 50.0, 200.0])
    parser.add_argument("--modes", nargs="+", default=["sync", "async-1"], help="sync or async-AGE")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3: the first step (engine warm-up) is not counted")
    try:
        ages = sync_or_async_ages(args.modes)
    except ValueError as err:
        parser.error(str(err))

    import yaml

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up
    from rlserve.v1 import coordinator_pb2 as pb

    root = Path(tempfile.mkdtemp(prefix="rlserve-bench-"))
    start = root / "models" / "guess-sft"
    data = default_cluster_data("vllm")  # vLLM serves the episodes' turns concurrently
    data.update({"ray_port": 6785, "grpc_port": 9305, "runs_dir": str(root / "runs"),
                 "model_dirs": [str(root / "models")]})
    data["reward"]["allowed_plugins"] = [PLUGIN]
    data["services"]["rollout"]["args"]["model"] = "preset:tiny-chat"
    data["services"]["reference"]["args"]["model"] = "preset:tiny-chat"
    cluster_file = root / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(data))
    cluster = Cluster(*load_cluster_file(cluster_file))
    rows = []
    up(cluster)
    try:
        with CoordinatorClient(cluster.grpc_endpoint) as client:
            run_id, _ = watch(client, warm_start_spec())
            shutil.copytree(root / "runs" / run_id / "sft_model", start)
            for mode in args.modes:
                for latency in args.latencies_ms:
                    run = client.submit(yaml.safe_dump(spec(args.steps, ages[mode], latency, start)))
                    steps = [dict(ev.metrics) for ev in client.watch(run.run_id) if ev.kind == pb.EVENT_KIND_STEP]
                    final = client.get(run.run_id)
                    if final.state != pb.RUN_STATE_SUCCEEDED:
                        raise SystemExit(f"{mode} {latency} ms: the run {final.run_id} ended {final.state}: {final.error}")
                    med = lambda key: statistics.median(m.get(key, float("nan")) for m in steps[1:])  # noqa: E731
                    turns = med("episode/turns_mean")
                    rows.append({"mode": mode, "latency_ms": latency, "step_s": med("timing/step_s"),
                                 "trajectories_per_s": med("batch/trajectories_trained") / med("timing/step_s"),
                                 "engine_idle": med("engine/idle_fraction"), "turns_mean": turns,
                                 "env_calls_per_step": med("batch/trajectories_trained") * (turns + 1)})
                    print(table(rows[-1:], COLUMNS), flush=True)
    finally:
        down(cluster)
    for r in rows:
        base = next(b for b in rows if b["mode"] == r["mode"] and b["latency_ms"] == min(args.latencies_ms))
        r["slowdown_vs_0ms"] = r["step_s"] / base["step_s"]
    print(table(rows, COLUMNS))
    print("wrote", record("multiturn_latency", rows, {
        "steps": args.steps, "workload": "examples/grpo_guess_number.yaml from its SFT warm start: 32 prompts x 8 "
                                         "episodes, up to 4 turns of 4 tokens, tiny-chat"}))


if __name__ == "__main__":
    main()
