"""Where a GRPO step's wall time goes, on the demo workload: each component's wall seconds beside its
own compute, so every gap (RPC, serialization, the object store, polling, the coordinator's Python)
has a name and a size.

The run is `examples/grpo_addition.yaml` without its SFT warm start (64 prompts x 8 samples, 6 new
tokens, 2 optimizer updates a step; partial credit, and every group trains), synchronous and async (max age 1), on the default cluster
`make demo` uses (`shared`: every process may use every core; the transformers engine, new weights
handed over in shared memory), on the same layout with vLLM's CPU engine and its direct gloo transfer
(`shared-vllm`), and with generation and training on separate cores (`split`:
`examples/cluster_cpu_split.yaml`'s layout, vLLM's engine on core 0, the rest on core 1), side by side in one invocation; `vs_sync_shared` is the speed-up over the first. Per mode, the medians over the steps after
the first two (engine warm-up) of:

- generate, reward, reference: the Generate / Score / LogProbs calls' wall seconds and the services'
  own compute (the rest is plumbing); in async mode they overlap training, and only
  `wait_for_rollouts` is on the step's path;
- train: the TrainStep call against the learner's step (forward, backward, optimizer);
- weight sync: publishing the new weights against the learner's export and the engines' load;
- coordinator: the step's wall time not inside any call (advantages, the batch, metrics, events).

`overhead` is the step's wall time outside engine and learner compute: step - learner step -
min(wait for rollouts, engine compute); issue 27's target is 10% or less.

    .venv/bin/python scripts/bench/step_budget.py [--steps 12] [--modes sync async-1] [--layouts shared shared-vllm split]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import default_cluster_data, record, sync_or_async_ages, table  # noqa: E402

COLUMNS = ["mode", "layout", "component", "wall_s", "compute_s", "gap_s", "share_of_step", "vs_sync_shared"]
# component -> (wall metric, compute: the wall minus this plumbing metric, or this compute metric)
PARTS = {
    "generate": ("timing/generate_s", "-plumbing/generate_s"),
    "reward": ("timing/reward_s", "-plumbing/reward_s"),
    "reference": ("timing/reference_s", "-plumbing/reference_s"),
    "wait for rollouts": ("timing/wait_for_rollouts_s", None),
    "train": ("timing/train_s", "perf/learner_step_seconds"),
    "weight sync": ("timing/weight_sync_s", "-plumbing/weight_sync_s"),
}


def demo_spec(steps: int, age: int) -> dict:
    import yaml

    spec = yaml.safe_load((ROOT / "examples" / "grpo_addition.yaml").read_text())
    spec["name"] = "bench-step-budget"
    spec["sft"] = {"enabled": False}
    spec["grpo"].update({"max_num_steps": steps, "val_period": 0})
    spec["grpo"]["async_grpo"] = {"enabled": age > 0, "max_trajectory_age_steps": max(age, 1)}
    spec["checkpointing"] = {"enabled": False}
    # The untrained model scores 0 under exact_match: partial credit, and every group trains, so each
    # step does the demo's full work (its later steps, when groups differ).
    spec["reward"] = {"functions": [{"name": "exact_match", "args": {"partial_credit": True}}]}
    spec["grpo"]["skip_zero_advantage_groups"] = False
    return spec


def cluster_data(root: Path, layout: str) -> dict:
    import yaml

    data = default_cluster_data(None if layout == "shared" else "vllm")
    data.update({"ray_port": 6781, "grpc_port": 9301, "runs_dir": str(root / "runs")})
    if layout == "split":
        split = yaml.safe_load((ROOT / "examples" / "cluster_cpu_split.yaml").read_text())
        data["num_cpus"] = split["num_cpus"]
        for name, svc in split["services"].items():
            data["services"][name]["cpu_cores"] = svc["cpu_cores"]
        data["services"]["rollout"]["args"].update(split["services"]["rollout"]["args"])
    return data


def budget(mode: str, layout: str, steps: list[dict[str, float]]) -> list[dict]:
    med = lambda f: statistics.median(f(m) for m in steps)  # noqa: E731
    step_s = med(lambda m: m["timing/step_s"])
    rows = []
    for name, (wall_key, compute_key) in PARTS.items():
        wall = med(lambda m: m.get(wall_key, 0.0))
        if compute_key is None:
            compute = float("nan")
        elif compute_key.startswith("-"):
            compute = med(lambda m: m.get(wall_key, 0.0) - m.get(compute_key[1:], 0.0))
        else:
            compute = med(lambda m: m.get(compute_key, 0.0))
        rows.append({"mode": mode, "layout": layout, "component": name, "wall_s": wall, "compute_s": compute,
                     "gap_s": wall - compute, "share_of_step": wall / step_s})
    on_path = med(lambda m: m["timing/wait_for_rollouts_s"] + m["timing/train_s"] + m["timing/weight_sync_s"])
    rows.append({"mode": mode, "layout": layout, "component": "coordinator", "wall_s": step_s - on_path, "compute_s": float("nan"),
                 "gap_s": step_s - on_path, "share_of_step": (step_s - on_path) / step_s})
    engine = med(lambda m: min(m["timing/wait_for_rollouts_s"], m["timing/generate_s"] - m["plumbing/generate_s"]))
    overhead = step_s - med(lambda m: m["perf/learner_step_seconds"]) - engine
    rows.append({"mode": mode, "layout": layout, "component": "STEP", "wall_s": step_s, "compute_s": step_s - overhead,
                 "gap_s": overhead, "share_of_step": overhead / step_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--modes", nargs="+", default=["sync", "async-1"], help="sync or async-AGE")
    parser.add_argument("--layouts", nargs="+", default=["shared", "shared-vllm", "split"], choices=["shared", "shared-vllm", "split"])
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4: the first 2 steps (engine warm-up) are not counted")
    try:
        ages = sync_or_async_ages(args.modes)
    except ValueError as err:
        parser.error(str(err))

    import yaml

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up
    from rlserve.v1 import coordinator_pb2 as pb

    rows = []
    for layout in args.layouts:
        root = Path(tempfile.mkdtemp(prefix="rlserve-bench-"))
        cluster_file = root / "cluster.yaml"
        cluster_file.write_text(yaml.safe_dump(cluster_data(root, layout)))
        cluster = Cluster(*load_cluster_file(cluster_file))
        up(cluster)
        try:
            with CoordinatorClient(cluster.grpc_endpoint) as client:
                for mode in args.modes:
                    run = client.submit(yaml.safe_dump(demo_spec(args.steps, ages[mode])))
                    steps = [dict(ev.metrics) for ev in client.watch(run.run_id) if ev.kind == pb.EVENT_KIND_STEP]
                    final = client.get(run.run_id)
                    if final.state != pb.RUN_STATE_SUCCEEDED:
                        raise SystemExit(f"{mode}: the run {final.run_id} ended {final.state}: {final.error}")
                    rows += budget(mode, layout, steps[2:])
        finally:
            down(cluster)
    base = next(r["wall_s"] for r in rows if r["component"] == "STEP")
    for r in rows:
        if r["component"] == "STEP":
            r["vs_sync_shared"] = base / r["wall_s"]
    print(table(rows, COLUMNS))
    print("wrote", record("step_budget", rows, {"steps": args.steps, "layouts": args.layouts,
                                                "workload": "examples/grpo_addition.yaml without SFT, 64 x 8, "
                                                            "6 new tokens"}))


if __name__ == "__main__":
    main()
