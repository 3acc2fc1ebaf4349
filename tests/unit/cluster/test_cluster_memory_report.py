"""scripts/gpu/cluster_memory.py (the GPU stages' table of LoRA against full through the cluster) on files shaped
like a run's: metrics.jsonl, nvidia-smi's CSV and the ps snapshots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _run(out: Path, name: str, learner_s: float, ref_pass: float | None, peak: float, worker_mib: int) -> None:
    steps = [{"step": 0, "val/reward": 0.0}]
    for step in (1, 2, 3):
        m = {"step": step, "timing/step_s": 8.0, "timing/generate_s": 6.0, "timing/train_s": learner_s + 0.05,
             "perf/learner_step_seconds": learner_s, "perf/learner_peak_allocated_gib": peak}
        if ref_pass is not None:
            m["perf/learner_reference_seconds"] = ref_pass
        steps.append(m)
    (out / f"{name}-metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (out / f"{name}-gpu.csv").write_text(
        "timestamp, pid, process_name, used_gpu_memory [MiB]\n"
        "2026/12/07 08:00:00.100, 11, ray::ServeReplica:rollout:Rollout, 18432 MiB\n"
        "2026/12/07 08:00:00.100, 12, ray::ServeReplica:reference:Reference, 6144 MiB\n"
        f"2026/12/07 08:00:00.100, 13, [No data], {worker_mib} MiB\n"
        "2026/12/07 08:00:00.600, 11, ray::ServeReplica:rollout:Rollout, 20480 MiB\n")
    (out / f"{name}-ps.txt").write_text("   13 ray::LearnerWorker.train_step\n   11 ray::ServeReplica:rollout:Rollout\n")


def test_the_table_compares_the_learner_without_its_reference_pass_and_each_service_against_its_declaration(tmp_path):
    _run(tmp_path, "full", 1.0, None, 36.0, 40 * 1024)
    _run(tmp_path, "lora", 1.3, 0.3, 20.0, 24 * 1024)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/cluster_memory.py"), str(tmp_path),
                           f"full={ROOT / 'examples/cluster_gpu_one_1b.yaml'}",
                           f"lora={ROOT / 'examples/cluster_gpu_one_1b_lora.yaml'}", "--out", str(tmp_path / "t.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "learner peak 0.56x full's (<= 0.6: met), learner time 1.00x (<= 1.05: met)" in proc.stdout
    table = json.loads((tmp_path / "t.json").read_text())
    assert table["lora"]["GPU GiB learner worker (nvidia-smi peak)"] == 24.0  # named by its ps line
    assert table["full"]["GPU GiB rollout (nvidia-smi peak)"] == 20.0
    assert table["full"]["GPU GiB whole card (peak of the sum)"] == 64.0  # 18 + 6 + 40 in one sample
    assert table["full"]["GPU GiB learner worker declared"] == 42 and table["lora"]["GPU GiB learner worker declared"] == 26
    assert "measured above" not in proc.stdout
