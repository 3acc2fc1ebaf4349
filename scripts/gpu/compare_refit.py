"""Weight sync on one GPU, the weight store's path against the same-GPU handoff, from two runs' metrics.

    python3 scripts/gpu/compare_refit.py OUT/refit-store-metrics.jsonl OUT/refit-ipc-metrics.jsonl --out refit.json

Each file is a run's metrics.jsonl (one line per step) of the same workload on cluster files that differ
only in the rollout's `weight_transfer` (`none`: the store; `ipc`: CUDA IPC). Steps after the first two
count (the first pays warm-up; a session's first version always goes through the store). Prints medians
and the ratio, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

KEYS = ["timing/weight_sync_s", "weight_sync/direct_s", "weight_sync/store_copy_s", "plumbing/weight_sync_s",
        "weight_sync/direct_mib", "weight_sync/store_fetch_mib", "timing/train_s", "timing/generate_s",
        "timing/step_s"]


def medians(path: Path) -> dict[str, float]:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][2:]
    if not steps:
        raise SystemExit(f"{path}: fewer than 3 steps")
    return {k: statistics.median(s.get(k, 0.0) for s in steps) for k in KEYS} | {"steps": len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store", type=Path)
    parser.add_argument("ipc", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = {"store": medians(args.store), "ipc": medians(args.ipc)}
    print(f"{'median of steps 3+':28} {'store':>10} {'ipc':>10} {'ipc/store':>10}")
    for k in KEYS:
        a, b = rows["store"][k], rows["ipc"][k]
        print(f"{k:28} {a:10.3f} {b:10.3f} {(b / a if a else float('nan')):10.3f}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
