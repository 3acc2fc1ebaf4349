"""What healing a shared learner group costs per step: a snapshot against a checkpoint and the step.

A learner whose runs share a worker group snapshots each run's trained state
after every step (`services/learner/app.py`), so that new workers can take
over where the dead ones were. Per model: a LoRA GRPO step (rank 16, every
linear layer, one gloo rank on CPU), then `save_snapshot` (a rank's own
shards as plain tensors, what the learner uses) and `save_checkpoint` (torch
distributed checkpoint) of the same state; medians over `--steps` steps after
a warm-up step.

    .venv/bin/python scripts/bench/snapshot.py [--presets tiny medium]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import record, table  # noqa: E402


def _measure(rank: int, world: int, preset: str, steps: int) -> dict:
    import torch

    from rlserve.config import parse_spec
    from rlserve.learner.dtensor.backend import DTensorBackend
    from rlserve.models import resolve_model
    from tests.support.batches import random_grpo_batch

    spec = {"policy": {"model_name": preset, "dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": 16}},
                       "train_global_batch_size": 6, "train_micro_batch_size": 2, "max_total_sequence_length": 32,
                       "generation": {"max_new_tokens": 8}}}
    b = DTensorBackend(parse_spec(spec), resolve_model(preset), torch.device("cpu"), None)
    times: dict[str, list[float]] = {"step": [], "snapshot": [], "checkpoint": []}
    folder = Path(tempfile.mkdtemp())
    try:
        for i in range(steps + 1):
            t0 = time.perf_counter()
            b.train_step(replace(random_grpo_batch(i), ref_logprobs=None), "grpo")
            t1 = time.perf_counter()
            shutil.rmtree(folder / "s", ignore_errors=True)
            b.save_snapshot(folder / "s")
            t2 = time.perf_counter()
            shutil.rmtree(folder / "c", ignore_errors=True)
            b.save_checkpoint(folder / "c")
            t3 = time.perf_counter()
            if i:  # the first step warms up
                for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                    times[key].append(seconds)
        size = sum(f.stat().st_size for f in (folder / "s").rglob("*") if f.is_file())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    step, snap, ckpt = (statistics.median(times[k]) * 1000 for k in times)
    return {"model": preset, "state_mib": size / 2**20, "step_ms": step, "snapshot_ms": snap, "checkpoint_ms": ckpt,
            "snapshot_of_step": snap / step, "checkpoint_of_step": ckpt / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "medium"])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    from tests.support.dist import run_ranks

    rows = [run_ranks(1, _measure, f"preset:{p}", args.steps)[0] for p in args.presets]
    print(table(rows, ["model", "state_mib", "step_ms", "snapshot_ms", "checkpoint_ms", "snapshot_of_step",
                       "checkpoint_of_step"]))
    print("results:", record("snapshot", rows, vars(args)))


if __name__ == "__main__":
    main()
