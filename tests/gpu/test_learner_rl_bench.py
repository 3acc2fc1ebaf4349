"""GPU-only smoke test of scripts/bench/learner_rl_gpu.py: every run kind completes on the tiny
model and reports real tokens/s and the padding it avoided. Skipped without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_rl_benchmark_runs_every_layout(tmp_path):
    out = tmp_path / "rl.json"
    runs = ["plain:padded", "dtensor:padded", "dtensor:packed", "dtensor:fixed", "dtensor-lora:packed",
            "dtensor-lora+ac0.5:packed"]
    try:
        import megatron.core  # noqa: F401

        runs.append("megatron:packed-ffd")
    except ImportError:  # megatron-core is optional on GPU machines
        pass
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench/learner_rl_gpu.py"), "--preset", "tiny",
                           "--seqs", "12", "--prompt", "8", "--max-len", "96", "--median-completion", "30",
                           "--micro-batch", "4",
                           "--pack-tokens", "256", "--fixed-seq", "64", "--steps", "1", "--lora-rank", "8", "--runs", *runs,
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(runs) and not [r for r in rows.values() if "error" in r]
    assert rows["dtensor:packed"]["padding_overhead"] == 0 < rows["dtensor:padded"]["padding_overhead"]
    assert all(r["real_tokens_per_s"] > 0 for r in rows.values())
    # LoRA rows, with a share of the layers checkpointed or none, are measured against full fine-tuning.
    assert all(rows[r]["peak_mem_vs_full"] > 0 for r in ("dtensor-lora:packed", "dtensor-lora+ac0.5:packed"))
