"""The multi-GPU benchmark's logic, run on gloo CPU ranks with the tiny model (a dry run: its
numbers mean nothing here, but every phase must run, agree on losses and move the weights)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_on_cpu_runs_every_phase_and_layouts_agree(tmp_path):
    out = tmp_path / "multi_gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench/multi_gpu.py"), "--device", "cpu",
                           "--preset", "tiny", "--seq", "32", "--batch", "8", "--micro-batch", "2", "--steps", "3",
                           "--lr", "1e-3", "--loss-rtol", "1e-5", "--bucket-mb", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["phase"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"megatron tp=1", "megatron tp=2", "megatron pp=2", "megatron dp=2", "dtensor dp=1",
                         "dtensor fsdp=2", "weights 0->1"}
    for name, row in rows.items():
        if name.startswith("weights"):
            assert row["buckets"] > 1 and row["nccl_broadcast_s"] > 0 and row["host_memory_s"] > 0
        else:
            assert row["losses_match"] and len(row["losses"]) == 3 and row["losses"][-1] < row["losses"][0]
    assert "tp=2" in rows["megatron tp=2"]["layout"] and "pp=2" in rows["megatron pp=2"]["layout"]
    assert "dp=2" in rows["megatron dp=2"]["layout"] and "dp=2" in rows["dtensor fsdp=2"]["layout"]
