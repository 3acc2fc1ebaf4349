"""Two LoRA runs at once on one cluster against each run alone, in one benchmark run (issue 22).

The demo task (reversed 2-digit addition) from one start point: the demo's SFT warm start, made
on a first cluster and then deployed as the rollout's model on a second one (the base both LoRA
runs adapt, so they share the engines and the learner's frozen base). Run A and run B (LoRA rank 16
on every linear layer, and rank 8 on attention only, other seeds) train `--steps` steps each:
A alone, B alone, then A and B submitted together. Reported per run: held-out reward at its end,
trajectories trained per second (first to last STEP event), and for the pair the combined rate
against one run alone and the ratio of the two runs' rates. Then B's rate beside A in three more
pairs: A at priority 2 (the fair share's weight), A whose reward plug-in raises on every item (it
fails alone), and A and B's shared learner worker killed at A's step `--kill-at` (the learner
heals the group; no step is lost).

    .venv/bin/python scripts/bench/concurrent_lora.py [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import default_cluster_data, record, table  # noqa: E402
from scripts.bench.curves import load_example, warm_start_spec  # noqa: E402

BROKEN_PLUGIN = "def reward(item):\n    raise ValueError('the grader is broken')\n"

RUNS = {"A": ({"dim": 16, "alpha": 32, "target_modules": [], "match_all_linear": True}, 1),
        "B": ({"dim": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
               "match_all_linear": False}, 2)}


def lora_spec(name: str, start: Path, steps: int, sync: bool, **top: object) -> dict:
    """Run `name`'s spec (on-policy with `sync`); `top` sets top-level keys (priority, reward)."""
    lora, seed = RUNS[name]
    spec = copy.deepcopy(load_example("grpo_addition_lora.yaml"))
    spec["name"] = f"concurrent-{name.lower()}"
    spec["sft"] = {"enabled": False}
    spec["policy"]["model_name"] = str(start)
    spec["policy"]["dtensor_cfg"] = {"lora_cfg": {"enabled": True, **lora}}
    spec["grpo"].update({"max_num_steps": steps, "val_period": steps, "seed": seed})
    spec["data"]["seed"] = seed
    spec["checkpointing"] = {"enabled": False}
    if sync:
        spec["grpo"]["async_grpo"] = {"enabled": False}
    spec.update(top)
    return spec


def cluster_file(root: Path, rollout_model: str | None) -> Path:
    import yaml

    data = default_cluster_data("vllm")  # vLLM batches the runs' adapters together
    data.update({"ray_port": 6784, "grpc_port": 9304, "runs_dir": str(root / "runs"),
                 "model_dirs": [str(root / "models")], "data_dirs": [str(root / "data")]})
    data["tenancy"]["cluster"]["max_training_runs"] = 2
    if rollout_model is not None:
        rollout = data["services"]["rollout"]
        rollout["args"].update({"model": rollout_model, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16})
        data["services"]["reference"]["args"]["model"] = rollout_model
        data.setdefault("reward", {})["allowed_plugins"] = [str(root / "plugins" / "broken.py:reward")]
        data["tenancy"]["default_user"]["max_priority"] = 2.0  # the priority pair
    path = root / ("cluster_lora.yaml" if rollout_model else "cluster.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def kill_learner_worker_at(client, run_id: str, step: int) -> None:  # noqa: ANN001 - a CoordinatorClient
    """SIGKILL the learner's worker process(es) once `run_id` has reached `step`."""
    import os
    import signal

    import psutil

    from rlserve.v1 import coordinator_pb2 as pb

    for ev in client.watch(run_id):
        if ev.kind == pb.EVENT_KIND_STEP and ev.step >= step:
            break
    for p in psutil.process_iter(["cmdline"]):
        if (p.info["cmdline"] or [""])[0].startswith("ray::LearnerWorker"):
            os.kill(p.pid, signal.SIGKILL)
            print(f"  killed learner worker {p.pid} at {run_id}'s step {step}", flush=True)


def run_pair(client, label: str, specs: dict[str, dict], measured: list[str],  # noqa: ANN001 - a CoordinatorClient
         during=None) -> list[dict]:  # noqa: ANN001 - what to do while they run
    """`specs` submitted together; the rows of the `measured` ones once all have ended."""
    import yaml

    runs = {name: client.submit(yaml.safe_dump(spec), run_id=f"{label}-{name}") for name, spec in specs.items()}
    if during is not None:
        during(runs)
    for run in runs.values():
        list(client.watch(run.run_id))
    rows = [summarise(client, runs[name].run_id, f"{name} {label}") for name in measured]
    for row in rows:
        print(f"  {row}", flush=True)
    return rows


def summarise(client, run_id: str, label: str) -> dict:  # noqa: ANN001 - a CoordinatorClient
    from rlserve.v1 import coordinator_pb2 as pb

    run = client.get(run_id)
    if run.state != pb.RUN_STATE_SUCCEEDED:
        raise SystemExit(f"{run_id} ended {pb.RunState.Name(run.state)}: {run.error}")
    events = list(client.watch(run_id))
    steps = [ev for ev in events if ev.kind == pb.EVENT_KIND_STEP]
    vals = [ev.metrics["val/reward"] for ev in events if ev.kind == pb.EVENT_KIND_VALIDATION
            and "val/reward" in ev.metrics]
    trajectories = sum(ev.metrics.get("batch/trajectories_trained", 0.0) for ev in steps)
    wall = steps[-1].time_unix - steps[0].time_unix
    return {"phase": label, "run": run_id, "val_start": vals[0], "val_end": vals[-1], "steps": len(steps),
            "trajectories": trajectories, "first_step": steps[0].time_unix, "last_step": steps[-1].time_unix,
            "trajectories_per_s": trajectories * (len(steps) - 1) / len(steps) / max(wall, 1e-9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kill-at", type=int, default=5, help="A's step at which the learner worker is killed")
    ap.add_argument("--no-faults", action="store_true", help="the first three phases only")
    ap.add_argument("--sync", action="store_true", help="on-policy GRPO (the example's async loop off)")
    args = ap.parse_args()

    import yaml

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up

    root = Path(tempfile.mkdtemp(prefix="rlserve-concurrent-"))
    (root / "models").mkdir()
    (root / "plugins").mkdir()
    (root / "plugins" / "broken.py").write_text(BROKEN_PLUGIN)
    start = root / "models" / "start"
    cluster = Cluster(*load_cluster_file(cluster_file(root, None)))
    up(cluster)
    try:
        with CoordinatorClient(cluster.grpc_endpoint) as client:
            run = client.submit(yaml.safe_dump(warm_start_spec("addition", root / "data")))
            list(client.watch(run.run_id))
            shutil.copytree(root / "runs" / run.run_id / "sft_model", start)
    finally:
        down(cluster)
    print(f"start point: {start}", flush=True)

    def spec_of(name: str, **top: object) -> dict:
        return lora_spec(name, start, args.steps, args.sync, **top)

    cluster = Cluster(*load_cluster_file(cluster_file(root, str(start))))
    up(cluster)
    rows = []
    try:
        with CoordinatorClient(cluster.grpc_endpoint) as client:
            for name in RUNS:
                run = client.submit(yaml.safe_dump(spec_of(name)), run_id=f"alone-{name}")
                list(client.watch(run.run_id))
                rows.append(summarise(client, run.run_id, f"{name} alone"))
                print(f"  {rows[-1]}", flush=True)
            t0 = time.time()
            together = [client.submit(yaml.safe_dump(spec_of(name)), run_id=f"together-{name}")
                        for name in RUNS]
            for run in together:
                list(client.watch(run.run_id))
            for name, run in zip(RUNS, together):
                rows.append(summarise(client, run.run_id, f"{name} together"))
                print(f"  {rows[-1]}", flush=True)
            wall = time.time() - t0
            if not args.no_faults:
                broken = {"functions": [{"name": "broken", "import_path": str(root / "plugins" / "broken.py:reward")}]}
                rows += run_pair(client, "priority", {"A": spec_of("A", priority=2.0),
                                                  "B": spec_of("B")}, ["A", "B"])
                rows += run_pair(client, "beside-failing", {"A": spec_of("A", reward=broken),
                                                        "B": spec_of("B")}, ["B"])
                rows += run_pair(client, "worker-killed", {name: spec_of(name) for name in RUNS},
                             ["A", "B"], lambda runs: kill_learner_worker_at(client, runs["A"].run_id, args.kill_at))
    finally:
        down(cluster)
    alone = {r["phase"][0]: r for r in rows if r["phase"].endswith("alone")}
    pair = [r for r in rows if r["phase"].endswith("together")]
    span = max(r["last_step"] for r in pair) - min(r["first_step"] for r in pair)
    combined = sum(r["trajectories"] for r in pair) / span
    summary = {"phase": "A and B together", "trajectories_per_s": combined,
               "vs_one_alone": combined / (sum(r["trajectories_per_s"] for r in alone.values()) / len(alone)),
               "rate_ratio_b_to_a": pair[1]["trajectories_per_s"] / pair[0]["trajectories_per_s"],
               "wall_s": wall}
    b_beside_a = next(r["trajectories_per_s"] for r in rows if r["phase"] == "B together")
    for r in rows:
        if r["phase"].startswith("B"):
            r["b_vs_beside_healthy_a"] = r["trajectories_per_s"] / b_beside_a
    print(table(rows, ["phase", "val_start", "val_end", "steps", "trajectories_per_s", "b_vs_beside_healthy_a"]))
    print(table([summary], ["phase", "trajectories_per_s", "vs_one_alone", "rate_ratio_b_to_a"]))
    print("results:", record("concurrent_lora_sync" if args.sync else "concurrent_lora", rows + [summary],
                             vars(args)))


if __name__ == "__main__":
    main()
