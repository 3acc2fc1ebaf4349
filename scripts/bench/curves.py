"""Learning curves: several algorithms on the same task, model, start point and cores, one run at a time.

For each task the harness first makes one start point (the demo's SFT warm start, run once and
copied into the cluster's model directory), then runs every algorithm from it with docs/algorithms.md's
recipe for that algorithm (the `examples/grpo_addition*.yaml` specs, or the GRPO spec with the keys
that make the variant), validating every `--val-period` steps on the same held-out prompts. It
plots held-out reward against wall-clock seconds and against trajectories trained (one PNG, a
row per task) and writes the curves as JSON.

Tasks: `addition` (the demo: reversed 2-digit addition, a built-in synthetic task) and `sort` (a
task of a different kind: sort four digits, `sort:5281=` -> `1258`, from JSONL files the harness
writes and reads through `data.task: jsonl`).

    .venv/bin/python scripts/bench/curves.py [--steps 60] [--tasks addition sort] \\
        [--algorithms grpo dapo gspo cispo rloo reinforce_pp] [--val-period 10] [--out curves]

Wall seconds count from the run's first validation (step 0) and include the later validation
passes, which cost every algorithm the same.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import RESULTS_DIR, plot_curves, record, table  # noqa: E402

EXAMPLES = ROOT / "examples"
# algorithm -> (the example spec it starts from, the keys that make it; nested dicts are merged)
ALGORITHMS: dict[str, tuple[str, dict]] = {
    "grpo": ("grpo_addition.yaml", {}),
    "dapo": ("grpo_addition_dapo.yaml", {}),
    "gspo": ("grpo_addition_gspo.yaml", {}),  # the paper's clip, 3e-4 / 4e-4
    "cispo": ("grpo_addition_cispo.yaml", {}),
    "rloo": ("grpo_addition.yaml", {"grpo": {"adv_estimator": {"name": "grpo", "normalize_rewards": False,
                                                               "use_leave_one_out_baseline": True}}}),
    "reinforce_pp": ("grpo_addition_reinforce_pp.yaml", {}),
    # Not in the default set: GRPO with GSPO's sequence-mean loss but per-token ratios (the GRPO paper's
    # form), to tell the effect of GSPO's ratios from that of its loss aggregation.
    "grpo_seqmean": ("grpo_addition.yaml", {"loss_fn": {"token_level_loss": False}}),
    # GSPO with GRPO's clip range (0.2), which did not learn (the recipe before it took the paper's).
    "gspo_clip_0.2": ("grpo_addition_gspo.yaml", {"loss_fn": {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2}}),
}
DEFAULT_ALGORITHMS = ["grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp"]
TASKS = ("addition", "sort")
SORT_DIGITS = 4
COLUMNS = ["task", "algorithm", "steps", "val_start", "val_end", "gain", "val_best", "train_s",
           "trajectories_per_s", "time_to_gain_0.2_s"]


def merged(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def write_sort_task(data_dir: Path, n_train: int = 4000, n_val: int = 128, seed: int = 7) -> tuple[Path, Path]:
    """Train and held-out JSONL files of the sort task; no held-out prompt is a training prompt."""
    rng = random.Random(seed)
    prompts: dict[str, str] = {}
    while len(prompts) < n_train + n_val:
        digits = "".join(rng.choice("0123456789") for _ in range(SORT_DIGITS))
        prompts.setdefault(f"sort:{digits}=", "".join(sorted(digits)))
    rows = [json.dumps({"prompt": p, "answer": a}) for p, a in prompts.items()]
    data_dir.mkdir(parents=True, exist_ok=True)
    train, val = data_dir / "sort_train.jsonl", data_dir / "sort_val.jsonl"
    train.write_text("\n".join(rows[:n_train]) + "\n")
    val.write_text("\n".join(rows[n_train:]) + "\n")
    return train, val


def with_task(spec: dict, task: str, data_dir: Path) -> dict:
    """`spec` (an addition example) on `task`: the sort task replaces the whole data section."""
    if task == "sort":
        train, val = write_sort_task(data_dir)
        spec["data"] = {"task": "jsonl", "train_path": str(train), "val_path": str(val)}
    return spec


def load_example(name: str) -> dict:
    import yaml

    return yaml.safe_load((EXAMPLES / name).read_text())


def warm_start_spec(task: str, data_dir: Path) -> dict:
    """The demo's SFT warm start then one GRPO step (a run must train): its `sft_model/` is the start point."""
    spec = with_task(load_example("grpo_addition.yaml"), task, data_dir)
    spec["name"] = f"curves-{task}-warm-start"
    spec["grpo"].update({"max_num_steps": 1, "val_period": 0})
    spec["checkpointing"] = {"enabled": False}
    return spec


def algorithm_spec(algorithm: str, task: str, data_dir: Path, start: Path, steps: int, val_period: int) -> dict:
    example, keys = ALGORITHMS[algorithm]
    spec = with_task(merged(load_example(example), keys), task, data_dir)
    spec["name"] = f"curves-{task}-{algorithm}"
    spec["sft"] = {"enabled": False}
    spec["policy"]["model_name"] = str(start)
    spec["grpo"].update({"max_num_steps": steps, "val_period": val_period})
    spec["checkpointing"] = {"enabled": False}
    return spec


def watch(client, spec: dict) -> tuple[str, list]:  # noqa: ANN001 - a CoordinatorClient
    import yaml

    from rlserve.v1 import coordinator_pb2 as pb

    run = client.submit(yaml.safe_dump(spec))
    events = list(client.watch(run.run_id))
    final = client.get(run.run_id)
    if final.state != pb.RUN_STATE_SUCCEEDED:
        raise SystemExit(f"{spec['name']}: the run {final.run_id} ended {pb.RunState.Name(final.state)}: "
                         f"{final.error}")
    return run.run_id, events


def curve(events: list) -> list[dict]:
    """(steps trained, wall seconds since the step-0 validation, trajectories trained, held-out reward) at each
    validation. A step's STEP event comes after the validation that follows it, so a validation's step is its
    weight version (one per step) and its trajectories are those of that many STEP events."""
    from rlserve.v1 import coordinator_pb2 as pb

    per_step = [ev.metrics.get("batch/trajectories_trained", 0.0) for ev in events if ev.kind == pb.EVENT_KIND_STEP]
    vals = [ev for ev in events if ev.kind == pb.EVENT_KIND_VALIDATION and "val/reward" in ev.metrics]
    return [{"step": int(ev.metrics["val/weight_version"]), "wall_s": ev.time_unix - vals[0].time_unix,
             "trajectories": sum(per_step[:int(ev.metrics["val/weight_version"])]),
             "val_reward": ev.metrics["val/reward"]} for ev in vals]


def summary(task: str, algorithm: str, points: list[dict]) -> dict:
    start, end = points[0]["val_reward"], points[-1]["val_reward"]
    reached = next((p["wall_s"] for p in points if p["val_reward"] >= start + 0.2), math.nan)
    return {"task": task, "algorithm": algorithm, "steps": points[-1]["step"], "val_start": start, "val_end": end,
            "gain": end - start, "val_best": max(p["val_reward"] for p in points), "train_s": points[-1]["wall_s"],
            "trajectories_per_s": points[-1]["trajectories"] / max(points[-1]["wall_s"], 1e-9),
            "time_to_gain_0.2_s": reached}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--val-period", type=int, default=10)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--algorithms", nargs="+", default=DEFAULT_ALGORITHMS, choices=list(ALGORITHMS))
    parser.add_argument("--out", default="curves", help="bench-results/OUT.json and OUT.png")
    args = parser.parse_args()
    if args.steps < 1 or not 1 <= args.val_period <= args.steps:
        parser.error("--steps must be positive and --val-period in 1..steps")

    import yaml

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.cluster.config import default_cluster_file, load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up

    root = Path(tempfile.mkdtemp(prefix="rlserve-curves-"))
    models_dir, data_dir = root / "models", root / "data"
    models_dir.mkdir()
    data = yaml.safe_load(default_cluster_file().read_text())
    data.update({"ray_port": 6783, "grpc_port": 9303, "runs_dir": str(root / "runs"),
                 "model_dirs": [str(models_dir)], "data_dirs": [str(data_dir)]})
    cluster_file = root / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(data))
    cluster = Cluster(*load_cluster_file(cluster_file))
    curves: dict[str, dict[str, list[dict]]] = {}
    rows = []
    up(cluster)
    try:
        with CoordinatorClient(cluster.grpc_endpoint) as client:
            for task in args.tasks:
                t0 = time.perf_counter()
                run_id, _ = watch(client, warm_start_spec(task, data_dir))
                start = models_dir / f"{task}-start"
                shutil.copytree(root / "runs" / run_id / "sft_model", start)
                print(f"{task}: start point from {run_id} in {time.perf_counter() - t0:.0f}s", flush=True)
                curves[task] = {}
                for algorithm in args.algorithms:
                    _, events = watch(client, algorithm_spec(algorithm, task, data_dir, start, args.steps,
                                                             args.val_period))
                    curves[task][algorithm] = curve(events)
                    rows.append(summary(task, algorithm, curves[task][algorithm]))
                    print(table(rows[-1:], COLUMNS), flush=True)
                    written = save(rows, curves, args, args.out)  # after every run: a stopped harness keeps what it measured
    finally:
        down(cluster)
    print(table(rows, COLUMNS))
    print("wrote", *written)


def save(rows: list[dict], curves: dict[str, dict[str, list[dict]]], args: argparse.Namespace,
         name: str) -> tuple[Path, Path]:
    RESULTS_DIR.mkdir(exist_ok=True)
    png = RESULTS_DIR / f"{name}.png"
    plot_curves(curves, [("wall_s", "wall-clock seconds"), ("trajectories", "trajectories trained")], png)
    return png, record(name, rows, {"steps": args.steps, "val_period": args.val_period, "curves": curves,
                                        "note": "one run per algorithm and task, from the same start point"})


if __name__ == "__main__":
    main()
