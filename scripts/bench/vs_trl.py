"""rlserve against TRL's GRPOTrainer on one machine, the demo workload, one run at a time.

Both start from the same model (the demo's SFT warm start, made once by rlserve and copied into the
cluster's model directory), take the same training prompts in the same order (rlserve's sampler
order, given to TRL with its shuffling off), and use the demo's hyperparameters: 64 prompts x 8
samples, temperature 1, 6 new tokens, lr 1e-4 (AdamW, constant), no KL, clip 0.2, token-level loss
(TRL's `dapo`), rewards normalised per group, 2 updates of 256 a step, 60 steps, exact match, greedy
held-out reward on the same 128 prompts every 10 steps. rlserve runs sync (`make demo`'s mode on a
2-core machine), async (max age 1) and streaming with in-flight updates, each on a cluster whose rollout engine is
transformers' `generate` with the shared-memory weight handoff (the default cluster's: rlserve's
colocated mode on one machine) and on one with vLLM's CPU engine and its direct gloo transfer; TRL runs in a separate environment
(`bench-envs/trl`: a venv that sees the project's packages through a .pth file and adds TRL and its
own dependencies, never touching the project's lock), in-process transformers generation.

Reported per system: train seconds (evaluation excluded), trajectories per second (generated, scored
and given to the loss, 512 a step in both systems; rlserve also reports the share it trained on, after
dropping groups without reward variance, which TRL trains at zero advantage), train
seconds to held-out 0.7 (at the first validation at or above it, and interpolated between validations),
held-out at 60; ratios to TRL; curves in one PNG.

    .venv/bin/python scripts/bench/vs_trl.py [--steps 60] [--modes sync async stream] [--engines transformers vllm]
        [--trl-version 1.16.0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import RESULTS_DIR, default_cluster_data, plot_curves, record, table  # noqa: E402
from scripts.bench.curves import load_example, merged, warm_start_spec, watch  # noqa: E402

TRL_ENV = ROOT / "bench-envs" / "trl"
# mode -> (example spec, keys over it)
MODES = {
    "sync": ("grpo_addition.yaml", {"grpo": {"async_grpo": {"enabled": False}}}),
    "async": ("grpo_addition.yaml", {"grpo": {"async_grpo": {"enabled": True}}}),
    "stream": ("grpo_addition_in_flight.yaml", {}),
}
COLUMNS = ["system", "train_s", "trajectories_per_s", "vs_trl", "trained_share", "s_to_0.7", "s_to_0.7_interp",
           "val_at_end"]


def trl_python(version: str) -> Path:
    """The TRL environment's interpreter, made on first use: the project's packages through a .pth file
    (torch, transformers), TRL and what it adds installed into the environment itself."""
    python = TRL_ENV / "bin" / "python"
    probe = [str(python), "-c", f"import trl; assert trl.__version__ == {version!r}"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    import site
    import sysconfig

    subprocess.run([sys._base_executable, "-m", "venv", "--clear", str(TRL_ENV)], check=True)  # noqa: SLF001
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    project = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (Path(purelib) / "rlserve_project.pth").write_text("\n".join(dict.fromkeys(project)) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"trl=={version}"],
                   check=True)
    subprocess.run(probe, check=True)
    return python


def rlserve_points(events: list, per_step: int) -> list[dict]:
    """(steps, train seconds, trajectories, held-out) at each validation. Train seconds are the steps' own
    (`timing/step_s`: generation or waiting for it, training, weight sync), validations left out. A step's
    STEP event comes after the validation that follows it: a validation's step is its weight version.
    Trajectories are those generated and scored (`per_step` a step), as TRL's are counted; `trained` leaves
    out the groups rlserve drops for having no reward variance (TRL computes them, at zero advantage)."""
    from rlserve.v1 import coordinator_pb2 as pb

    steps = [ev.metrics for ev in events if ev.kind == pb.EVENT_KIND_STEP]
    points = []
    for ev in events:
        if ev.kind == pb.EVENT_KIND_VALIDATION and "val/reward" in ev.metrics:
            done = steps[:int(ev.metrics["val/weight_version"])]
            points.append({"step": len(done), "train_s": sum(m["timing/step_s"] for m in done),
                           "trajectories": len(done) * per_step,
                           "trained": sum(m.get("batch/trajectories_trained", 0.0) for m in done),
                           "val_reward": ev.metrics["val/reward"]})
    return points


def row(system: str, points: list[dict]) -> dict:
    end = points[-1]
    return {"system": system, "train_s": end["train_s"], "trajectories_per_s": end["trajectories"] / end["train_s"],
            "trained_share": end.get("trained", end["trajectories"]) / end["trajectories"],
            "s_to_0.7": next((p["train_s"] for p in points if p["val_reward"] >= 0.7), math.nan),
            "s_to_0.7_interp": crossing(points, 0.7), "val_at_end": end["val_reward"]}


def crossing(points: list[dict], level: float) -> float:
    """Train seconds where held-out reward first reaches `level`, linear between the two validations around
    it (validations every 10 steps make the first one at or above `level` a coarse clock)."""
    for before, after in zip(points, points[1:]):
        if after["val_reward"] >= level > before["val_reward"]:
            frac = (level - before["val_reward"]) / (after["val_reward"] - before["val_reward"])
            return before["train_s"] + frac * (after["train_s"] - before["train_s"])
    return points[0]["train_s"] if points and points[0]["val_reward"] >= level else math.nan


def trl_inputs(spec: dict, start: Path, steps: int) -> dict:
    """The TRL side's inputs: rlserve's prompts in its sampler's order and the matched hyperparameters."""
    from rlserve.config.spec import RunSpec
    from rlserve.data.dataset import PromptSampler, build_splits

    run_spec = RunSpec.model_validate(spec)
    splits = build_splits(run_spec.data)
    g, p = run_spec.grpo, run_spec.policy
    sampler = PromptSampler(list(splits.train), run_spec.data.seed)
    train = sampler.take(steps * g.num_prompts_per_step)
    opt = p.optimizer.kwargs
    return {"model": str(start), "train": [{"prompt": e.prompt, "answer": e.answer} for e in train],
            "val": [{"prompt": e.prompt, "answer": e.answer} for e in splits.val[:g.max_val_samples]],
            "hyperparameters": {
                "steps": steps, "val_period": g.val_period, "num_generations": g.num_generations_per_prompt,
                "trajectories_per_step": g.num_prompts_per_step * g.num_generations_per_prompt,
                "update_batch_size": p.train_global_batch_size, "max_new_tokens": p.generation.max_new_tokens,
                "temperature": p.generation.temperature, "lr": opt.lr, "weight_decay": opt.weight_decay,
                "betas": list(opt.betas), "eps": opt.eps, "max_grad_norm": p.max_grad_norm,
                "clip": spec["loss_fn"]["ratio_clip_max"], "seed": g.seed, "threads": run_spec.cluster.torch_threads}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--engines", nargs="+", default=["transformers", "vllm"], choices=["transformers", "vllm"],
                        help="the rollout engine of each cluster, every mode on each")
    parser.add_argument("--trl-version", default="1.16.0")
    args = parser.parse_args()

    import yaml

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up

    python = trl_python(args.trl_version)
    root = Path(tempfile.mkdtemp(prefix="rlserve-vs-trl-"))
    models_dir = root / "models"
    models_dir.mkdir()
    start = models_dir / "start"
    curves: dict[str, list[dict]] = {}
    for engine in args.engines:
        data = default_cluster_data(engine)
        data.update({"ray_port": 6787, "grpc_port": 9307, "runs_dir": str(root / "runs"), "model_dirs": [str(models_dir)]})
        cluster_file = root / "cluster.yaml"
        cluster_file.write_text(yaml.safe_dump(data))
        cluster = Cluster(*load_cluster_file(cluster_file))
        up(cluster)
        try:
            with CoordinatorClient(cluster.grpc_endpoint) as client:
                if not start.exists():
                    run_id, _ = watch(client, warm_start_spec("addition", root / "data"))
                    shutil.copytree(root / "runs" / run_id / "sft_model", start)
                for mode in args.modes:
                    example, keys = MODES[mode]
                    spec = merged(load_example(example), keys)
                    spec.update({"name": f"vs-trl-{mode}", "sft": {"enabled": False}, "checkpointing": {"enabled": False}})
                    spec["policy"]["model_name"] = str(start)
                    spec["grpo"]["max_num_steps"] = args.steps
                    system = f"rlserve {mode}, {engine}"
                    per_step = spec["grpo"]["num_prompts_per_step"] * spec["grpo"]["num_generations_per_prompt"]
                    curves[system] = rlserve_points(watch(client, spec)[1], per_step)
                    print(table([row(system, curves[system])], COLUMNS), flush=True)
        finally:
            down(cluster)
    spec = merged(load_example("grpo_addition.yaml"), {"policy": {"model_name": str(start)}})
    (root / "trl.json").write_text(json.dumps(trl_inputs(spec, start, args.steps)))
    subprocess.run([str(python), str(ROOT / "scripts" / "bench" / "trl_grpo.py"), "--data", str(root / "trl.json"),
                    "--out", str(root / "trl_out.json")], check=True, env={**os.environ, "PYTHONPATH": ""})
    curves[f"TRL {args.trl_version}"] = json.loads((root / "trl_out.json").read_text())["points"]
    rows = [row(system, points) for system, points in curves.items()]
    trl_rate = rows[-1]["trajectories_per_s"]
    for r in rows:
        r["vs_trl"] = r["trajectories_per_s"] / trl_rate
    print(table(rows, COLUMNS))
    RESULTS_DIR.mkdir(exist_ok=True)
    plot_curves({"demo task": curves}, [("train_s", "train seconds (evaluation excluded)"),
                                        ("trajectories", "trajectories generated")], RESULTS_DIR / "vs_trl.png", 0.7)
    print("wrote", RESULTS_DIR / "vs_trl.png", record("vs_trl", rows, {"steps": args.steps, "curves": curves,
                                                                    "trl_version": args.trl_version}))


if __name__ == "__main__":
    main()
