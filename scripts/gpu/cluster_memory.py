"""Runs through the cluster side by side: step time, and each service's GPU memory against what its cluster file
declares (LoRA against full fine-tuning, issue 45).

    python3 scripts/gpu/cluster_memory.py OUT full=examples/cluster_gpu_one_1b.yaml \
        lora=examples/cluster_gpu_one_1b_lora.yaml --out OUT/lora.json

For each NAME=CLUSTER, `scripts/gpu/h200_run.sh`'s run_cluster left in OUT:
- NAME-metrics.jsonl: the run's metrics, a line per step (medians over steps 2 on: step 1 pays warm-up);
- NAME-gpu.csv: nvidia-smi's compute processes, sampled every 0.5 s (pid, process name, used MiB);
- NAME-ps.txt: `ps` snapshots of the same time, naming the processes nvidia-smi cannot (the learner's workers).

Rows: the step's phases; the learner's step, its own reference pass (a LoRA learner computes the KL term's
reference logprobs with its adapters off: the reference service's work in a full run) and the step without it;
the learner's peak from torch (tensors, and the allocator's reserve); each service's peak on the card
(nvidia-smi: its CUDA context included) beside the cluster file's gpu_memory_gib; the card's peak. With two
runs, the last column is the second over the first: the targets are LoRA's learner peak <= 0.6x and its
learner time (without the reference pass) <= 1.05x full's.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path

import yaml

MIB_PER_GIB = 1024
PHASES = [("step s", "timing/step_s"), ("generate s", "timing/generate_s"), ("reference s", "timing/reference_s"),
          ("train s", "timing/train_s"), ("weight sync s", "timing/weight_sync_s"),
          ("learner step s", "perf/learner_step_seconds"),
          ("learner's reference pass s", "perf/learner_reference_seconds")]
PEAKS = [("learner peak allocated GiB", "perf/learner_peak_allocated_gib"),
         ("learner peak reserved GiB", "perf/learner_peak_reserved_gib")]
# The cluster file's service whose gpu_memory_gib a process is measured against.
DECLARED_AS = {"rollout": "rollout", "reference": "reference", "learner worker": "learner"}


def steps_of(path: Path) -> list[dict]:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [s for s in steps if s.get("step", 0) >= 2 and "timing/step_s" in s]


def median(steps: list[dict], key: str) -> float | None:
    values = [s[key] for s in steps if key in s]
    return statistics.median(values) if values else None


def service_of(name: str, args: str) -> str:
    """The service a GPU process belongs to, from nvidia-smi's process name or its command line."""
    text = f"{name} {args}"
    if "VLLM::" in text or "EngineCore" in text:  # vLLM's engine process, a child of the rollout's replica
        return "rollout"
    for service in ("rollout", "reference", "reward"):
        if f":{service}:" in text or f"{service.capitalize()}" in text:
            return service
    if "LearnerWorker" in text or ":learner:" in text:
        return "learner worker"
    return f"other ({(args or name).strip()[:40]})"


def gpu_peaks(csv_path: Path, ps_path: Path) -> tuple[dict[str, float], float]:
    """Peak GiB per service over the samples, and the peak of their sum (the whole card's compute processes)."""
    args: dict[str, str] = {}
    if ps_path.is_file():
        for line in ps_path.read_text().splitlines():
            pid, _, rest = line.strip().partition(" ")
            if pid.isdigit() and rest.startswith(("ray::", "VLLM::")):
                args[pid] = rest
    if not csv_path.is_file():
        return {}, 0.0
    # One nvidia-smi sample's rows share its timestamp; a service's processes (vLLM's engine beside its replica,
    # several learner workers) add up within a sample.
    per_sample: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in csv.reader(csv_path.read_text().splitlines()):
        if len(row) < 4 or not row[3].strip().endswith("MiB"):
            continue
        stamp, pid, name, used = (c.strip() for c in row[:4])
        per_sample[stamp][service_of(name, args.get(pid, ""))] += float(used.removesuffix("MiB")) / MIB_PER_GIB
    per_service: dict[str, float] = defaultdict(float)
    for sample in per_sample.values():
        for service, gib in sample.items():
            per_service[service] = max(per_service[service], gib)
    return dict(per_service), max((sum(s.values()) for s in per_sample.values()), default=0.0)


def declared(cluster: Path) -> dict[str, float]:
    services = (yaml.safe_load(cluster.read_text()) or {}).get("services", {})
    return {name: svc["gpu_memory_gib"] for name, svc in services.items() if svc and "gpu_memory_gib" in svc}


def run_rows(out: Path, name: str, cluster: Path) -> dict[str, float | None]:
    steps = steps_of(out / f"{name}-metrics.jsonl")
    if not steps:
        raise SystemExit(f"{out / f'{name}-metrics.jsonl'}: no step after the first")
    row: dict[str, float | None] = {"steps measured": float(len(steps))}
    row.update({label: median(steps, key) for label, key in PHASES})
    learner, ref_pass = row["learner step s"], row["learner's reference pass s"]
    row["learner step without its reference pass s"] = None if learner is None else learner - (ref_pass or 0.0)
    row.update({label: max((s[key] for s in steps if key in s), default=None) for label, key in PEAKS})
    peaks, card = gpu_peaks(out / f"{name}-gpu.csv", out / f"{name}-ps.txt")
    needs = declared(cluster)
    for service in sorted(set(peaks) | set(DECLARED_AS)):
        row[f"GPU GiB {service} (nvidia-smi peak)"] = peaks.get(service)
        if service in DECLARED_AS:
            row[f"GPU GiB {service} declared"] = needs.get(DECLARED_AS[service])
    row["GPU GiB whole card (peak of the sum)"] = card
    row["GPU GiB declared in all"] = sum(needs.values()) if needs else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="h200_run.sh's OUT folder")
    parser.add_argument("runs", nargs="+", help="NAME=CLUSTER_FILE, each run_cluster's NAME and its cluster file")
    parser.add_argument("--out", dest="json_out", type=Path)
    args = parser.parse_args()
    runs = dict(r.split("=", 1) for r in args.runs)
    table = {name: run_rows(args.out, name, Path(cluster)) for name, cluster in runs.items()}
    names = list(table)
    labels = list(dict.fromkeys(k for row in table.values() for k in row))
    ratio = len(names) == 2
    print(f"{'median of steps 2+ / peak':48}" + "".join(f"{n:>12}" for n in names)
          + (f"{names[1] + '/' + names[0]:>14}" if ratio else ""))
    for label in labels:
        values = [table[n].get(label) for n in names]
        cells = "".join(f"{v:12.3f}" if v is not None else f"{'-':>12}" for v in values)
        if ratio and None not in values and values[0]:
            cells += f"{values[1] / values[0]:14.3f}"
        print(f"{label:48}{cells}")
    if ratio:
        full, lora = table[names[0]], table[names[1]]
        time_key, peak_key = "learner step without its reference pass s", "learner peak allocated GiB"
        if None not in (full[time_key], lora[time_key], full[peak_key], lora[peak_key]):
            t, m = lora[time_key] / full[time_key], lora[peak_key] / full[peak_key]
            print(f"target: {names[1]}'s learner peak {m:.2f}x {names[0]}'s (<= 0.6: {'met' if m <= 0.6 else 'missed'}), "
                  f"learner time {t:.2f}x (<= 1.05: {'met' if t <= 1.05 else 'missed'})")
    for name in names:
        over = [k for k in table[name] if k.endswith("(nvidia-smi peak)")
                and (table[name].get(k.replace("(nvidia-smi peak)", "declared")) or float("inf")) < (table[name][k] or 0)]
        if over:
            print(f"{name}: measured above declared: {', '.join(over)}")
    if args.json_out:
        args.json_out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
