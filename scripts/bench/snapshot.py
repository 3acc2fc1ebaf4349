"""What healing a shared learner group costs per step: a snapshot against a checkpoint and the step.

A learner whose runs share a worker group snapshots each run's trained state
after every step (`rlserve.learner.sessions`), so that new workers can take
over where the dead ones were. Per model: a LoRA GRPO step (rank 16, every
linear layer, one rank; sequences of random lengths, RL-shaped), then
`save_snapshot` (a rank's own shards as plain tensors, what the learner uses)
and `save_checkpoint` (torch distributed checkpoint) of the same state;
medians over `--steps` steps after a warm-up step. On a GPU in bf16.

    .venv/bin/python scripts/bench/snapshot.py [--presets tiny medium]
    python3 scripts/bench/snapshot.py --device cuda --presets 1b --seqs 64 --max-len 512   # the H200
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import record, table  # noqa: E402


def _measure(preset: str, device: str, steps: int, seqs: int, max_len: int, out) -> None:  # noqa: ANN001 - a Queue
    import torch

    from rlserve.config import parse_spec
    from rlserve.learner.dtensor.backend import DTensorBackend
    from rlserve.models import resolve_model
    from rlserve.training.batch import TrainBatch
    from rlserve.training.distributed import init_process_group

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    init_process_group(0, 1, f"file://{tempfile.mktemp(prefix='rlserve-bench-')}", dev)
    spec = parse_spec({"policy": {
        "precision": "bfloat16" if dev.type == "cuda" else "float32",
        "dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": 16}}, "train_global_batch_size": seqs,
        "train_micro_batch_size": min(seqs, 16), "max_total_sequence_length": max_len + 1,
        "generation": {"max_new_tokens": max_len // 2}}, "loss_fn": {"reference_policy_kl_penalty": 0.0}})
    b = DTensorBackend(spec, resolve_model(f"preset:{preset}"), dev, None)
    g = torch.Generator().manual_seed(0)
    prompt = max_len // 4
    times: dict[str, list[float]] = {"step": [], "snapshot": [], "checkpoint": []}
    folder = Path(tempfile.mkdtemp())
    try:
        for i in range(steps + 1):
            ids = [torch.randint(3, 60, (int(torch.randint(prompt + 8, max_len, (1,), generator=g)),),
                                 generator=g).tolist() for _ in range(seqs)]
            batch = TrainBatch.from_sequences(ids, [prompt] * seqs, [float(k % 2) - 0.5 for k in range(seqs)],
                                              [[-1.0] * (len(x) - prompt) for x in ids])
            t0 = time.perf_counter()
            b.train_step(batch, "grpo")
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
    out.put({"model": preset, "device": device, "sequences": seqs, "state_mib": size / 2**20, "step_ms": step,
             "snapshot_ms": snap, "checkpoint_ms": ckpt, "snapshot_of_step": snap / step,
             "checkpoint_of_step": ckpt / step})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "medium"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=8, help="sequences per step")
    ap.add_argument("--max-len", type=int, default=96, help="longest sequence (prompt a quarter of it)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for preset in args.presets:  # a process each: a fresh process group and allocator
        q = ctx.Queue()
        p = ctx.Process(target=_measure, args=(preset, args.device, args.steps, args.seqs, args.max_len, q))
        p.start()
        rows.append(q.get())
        p.join()
        print(f"  {rows[-1]}", flush=True)
    print(table(rows, ["model", "device", "state_mib", "step_ms", "snapshot_ms", "checkpoint_ms",
                       "snapshot_of_step", "checkpoint_of_step"]))
    print("results:", record("snapshot" if args.device == "cpu" else f"snapshot_{args.device}", rows, vars(args)))


if __name__ == "__main__":
    main()
