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

The systems alternate, `--runs` rounds of each (at least two): every round runs each rlserve system
(each engine's cluster brought up for it and down after it) and TRL once, the first round rlserve then
TRL, the next TRL then rlserve, and so on, so that a drift of the machine falls on both. While TRL runs,
no process of rlserve's cluster is alive: the processes of each cluster are recorded while it is up, and
before TRL starts and every half second while it runs the script checks (psutil) that none of them lives
(it stops with an error if one does); Ray processes of other clusters on the machine, and the load
average, are reported beside each TRL run, since the race is only fair on a machine with nothing else
running.

Reported per run: train seconds (evaluation excluded), trajectories per second (generated, scored and
given to the loss, 512 a step in both systems; rlserve also reports the share it trained on, after
dropping groups without reward variance, which TRL trains at zero advantage), train seconds to held-out
0.7 (at the first validation at or above it, and interpolated between validations), held-out at the end,
and its ratio to the TRL run of the same round. Per system: the median, the lowest and the highest
trajectories per second and their spread ((max - min) / median), and the lowest of its rounds' ratios to
TRL. Then the step budget per phase against TRL's on the same batch (medians over the steps after the
first two): generation, reward, the other scoring (rlserve: the reference's log-probabilities; TRL: the
old policy's and the advantages), the rollouts' time on the step's path, forward and backward, the weight
sync (rlserve only: TRL trains the model it generates with), and the rest (the optimizer, the trainer's or
the coordinator's own work). Curves in one PNG.

    .venv/bin/python scripts/bench/vs_trl.py [--steps 60] [--runs 2] [--modes sync async stream]
        [--engines transformers vllm] [--trl-version 1.16.0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
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
COLUMNS = ["round", "system", "train_s", "trajectories_per_s", "vs_trl", "trained_share", "s_to_0.7",
           "s_to_0.7_interp", "val_at_end"]
SUMMARY_COLUMNS = ["system", "runs", "median_traj_per_s", "min_traj_per_s", "max_traj_per_s", "spread",
                   "median_vs_trl", "min_vs_trl"]
PHASE_COLUMNS = ["system", "step_s", "generate_s", "reward_s", "scoring_other_s", "rollouts_s", "train_s",
                 "weight_sync_s", "optimizer_other_s"]
# rlserve's step metrics for the phases of the budget (the rest of the step: the coordinator's own work).
RLSERVE_PHASES = {"step_s": "timing/step_s", "generate_s": "timing/generate_s", "reward_s": "timing/reward_s",
                  "scoring_other_s": "timing/reference_s", "rollouts_s": "timing/wait_for_rollouts_s",
                  "train_s": "timing/train_s", "weight_sync_s": "timing/weight_sync_s"}


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


def row(system: str, points: list[dict], round_: int = 0) -> dict:
    end = points[-1]
    return {"round": round_, "system": system, "train_s": end["train_s"],
            "trajectories_per_s": end["trajectories"] / end["train_s"],
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


def rlserve_phases(events: list) -> list[dict]:
    """Each step's seconds by phase, from its STEP event's metrics (the rest: the coordinator's own work)."""
    from rlserve.v1 import coordinator_pb2 as pb

    phases = []
    for ev in events:
        if ev.kind == pb.EVENT_KIND_STEP:
            p = {name: ev.metrics.get(key, 0.0) for name, key in RLSERVE_PHASES.items()}
            p["optimizer_other_s"] = p["step_s"] - p["rollouts_s"] - p["train_s"] - p["weight_sync_s"]
            phases.append(p)
    return phases


def budget(system: str, phases: list[list[dict]]) -> dict:
    """The medians per phase over every run's steps after its first two (engine warm-up)."""
    steps = [p for run in phases for p in run[2:]] or [p for run in phases for p in run]
    return {"system": system, **{k: statistics.median(p.get(k, 0.0) for p in steps) for k in PHASE_COLUMNS[1:]}}


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for system in dict.fromkeys(r["system"] for r in rows):
        rates = [r["trajectories_per_s"] for r in rows if r["system"] == system]
        ratios = [r["vs_trl"] for r in rows if r["system"] == system]
        med = statistics.median(rates)
        out.append({"system": system, "runs": len(rates), "median_traj_per_s": med, "min_traj_per_s": min(rates),
                    "max_traj_per_s": max(rates), "spread": (max(rates) - min(rates)) / med,
                    "median_vs_trl": statistics.median(ratios), "min_vs_trl": min(ratios)})
    return out


def cluster_pids(cluster) -> dict[int, float]:  # noqa: ANN001 - a lifecycle.Cluster
    """Every process of the running cluster's local head, by pid with its start time: its session (`ray
    start` and all it spawned: GCS, raylet, agents, replicas, actors) and their descendants."""
    import psutil

    head = int((cluster.state_dir / "head.pid").read_text())
    procs = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == head:
                procs.append(p)
                procs.extend(p.children(recursive=True))
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    found = {}
    for p in procs:
        try:
            found[p.pid] = p.create_time()
        except psutil.Error:
            continue
    return found


def alive(pids: dict[int, float]) -> list[str]:
    """The processes of `pids` still running (the same pid and start time), by pid and command line."""
    import psutil

    found = []
    for pid, started in pids.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{pid} {' '.join(p.cmdline())[:80] or p.name()}")
        except psutil.Error:
            continue
    return found


def other_ray_processes() -> int:
    """Ray processes on the machine (other clusters: other people's tests), for the fairness note."""
    import psutil

    count = 0
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["name"] in ("gcs_server", "raylet") or cmd.startswith("ray::"):
            count += 1
    return count


class Guard:
    """Checks every half second, while TRL runs, that none of rlserve's cluster processes is alive."""

    def __init__(self, pids: dict[int, float]):
        self.pids, self.found, self.load = pids, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            self.found += alive(self.pids)
            self.load.append(os.getloadavg()[0])

    def __enter__(self) -> Guard:
        found = alive(self.pids)
        if found:
            raise SystemExit(f"rlserve's cluster is still alive before TRL's run: {found[:5]}")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.found:
            raise SystemExit(f"rlserve's cluster processes lived while TRL ran: {sorted(set(self.found))[:5]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=int, default=2, help="rounds; each runs every rlserve system and TRL once")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--engines", nargs="+", default=["transformers", "vllm"], choices=["transformers", "vllm"],
                        help="the rollout engine of each cluster, every mode on each")
    parser.add_argument("--trl-version", default="1.16.0")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1 (2 or more for a spread)")

    import yaml

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up

    python = trl_python(args.trl_version)
    root = Path(tempfile.mkdtemp(prefix="rlserve-vs-trl-"))
    models_dir = root / "models"
    models_dir.mkdir()
    start = models_dir / "start"
    trl_system = f"TRL {args.trl_version}"
    curves: dict[str, list[dict]] = {}
    rows: list[dict] = []
    phases: dict[str, list[list[dict]]] = {}
    fairness: list[dict] = []
    pids: dict[int, float] = {}

    def run_rlserve(round_: int) -> None:
        for engine in args.engines:
            data = default_cluster_data(engine)
            data.update({"ray_port": 6787, "grpc_port": 9307, "http_port": 9308, "runs_dir": str(root / "runs"),
                         "model_dirs": [str(models_dir)]})
            cluster_file = root / "cluster.yaml"
            cluster_file.write_text(yaml.safe_dump(data))
            cluster = Cluster(*load_cluster_file(cluster_file))
            up(cluster)
            try:
                pids.update(cluster_pids(cluster))
                with CoordinatorClient(cluster.grpc_endpoint) as client:
                    if not start.exists():
                        run_id, _ = watch(client, warm_start_spec("addition", root / "data"))
                        shutil.copytree(root / "runs" / run_id / "sft_model", start)
                    for mode in args.modes:
                        example, keys = MODES[mode]
                        spec = merged(load_example(example), keys)
                        spec.update({"name": f"vs-trl-{mode}", "sft": {"enabled": False},
                                     "checkpointing": {"enabled": False}})
                        spec["policy"]["model_name"] = str(start)
                        spec["grpo"]["max_num_steps"] = args.steps
                        system = f"rlserve {mode}, {engine}"
                        per_step = spec["grpo"]["num_prompts_per_step"] * spec["grpo"]["num_generations_per_prompt"]
                        events = watch(client, spec)[1]
                        curves[f"{system} #{round_}"] = points = rlserve_points(events, per_step)
                        phases.setdefault(system, []).append(rlserve_phases(events))
                        rows.append(row(system, points, round_))
                        print(table([rows[-1]], COLUMNS), flush=True)
                pids.update(cluster_pids(cluster))
            finally:
                down(cluster)

    def run_trl(round_: int) -> None:
        spec = merged(load_example("grpo_addition.yaml"), {"policy": {"model_name": str(start)}})
        (root / "trl.json").write_text(json.dumps(trl_inputs(spec, start, args.steps)))
        others = other_ray_processes()
        with Guard(pids) as guard:
            t0 = time.monotonic()
            subprocess.run([str(python), str(ROOT / "scripts" / "bench" / "trl_grpo.py"), "--data",
                            str(root / "trl.json"), "--out", str(root / "trl_out.json")], check=True,
                           env={**os.environ, "PYTHONPATH": ""})
        out = json.loads((root / "trl_out.json").read_text())
        curves[f"{trl_system} #{round_}"] = out["points"]
        phases.setdefault(trl_system, []).append(out["phases"])
        rows.append(row(trl_system, out["points"], round_))
        fairness.append({"round": round_, "wall_s": time.monotonic() - t0, "rlserve_processes_checked": len(pids),
                         "rlserve_processes_alive": len(set(guard.found)),
                         "other_ray_processes_at_start": others,
                         "load_avg_1m_max": max(guard.load, default=os.getloadavg()[0])})
        print(table([rows[-1]], COLUMNS), f"\nfairness: {fairness[-1]}", flush=True)

    for round_ in range(args.runs):
        for side in ([run_rlserve, run_trl] if round_ % 2 == 0 else [run_trl, run_rlserve]):
            side(round_)
    trl_rates = {r["round"]: r["trajectories_per_s"] for r in rows if r["system"] == trl_system}
    for r in rows:
        r["vs_trl"] = r["trajectories_per_s"] / trl_rates[r["round"]]
    rows.sort(key=lambda r: (r["round"], r["system"] == trl_system))
    sums = summary(rows)
    budgets = [budget(system, runs) for system, runs in phases.items()]
    print(table(rows, COLUMNS))
    print(table(sums, SUMMARY_COLUMNS))
    print(table(budgets, PHASE_COLUMNS))
    RESULTS_DIR.mkdir(exist_ok=True)
    plot_curves({"demo task": curves}, [("train_s", "train seconds (evaluation excluded)"),
                                        ("trajectories", "trajectories generated")], RESULTS_DIR / "vs_trl.png", 0.7)
    print("wrote", RESULTS_DIR / "vs_trl.png", record("vs_trl", rows, {
        "steps": args.steps, "runs": args.runs, "summary": sums, "step_budget": budgets, "fairness": fairness,
        "curves": curves, "trl_version": args.trl_version}))


if __name__ == "__main__":
    main()
