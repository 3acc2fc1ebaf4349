"""Shared bits of the benchmarks: timing, a results table, and the JSON record."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# RLSERVE_BENCH_RESULTS: elsewhere (a test that runs a benchmark keeps its results out of the checkout).
RESULTS_DIR = Path(os.environ.get("RLSERVE_BENCH_RESULTS") or Path(__file__).resolve().parents[2] / "bench-results")


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """Median wall seconds of `repeats` calls after `warmup` untimed ones, and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)), "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def record(name: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                "machine": platform.machine(), "python": platform.python_version(),
                                **meta, "rows": rows}, indent=1) + "\n")
    return path


def sync_or_async_ages(modes: list[str]) -> dict[str, int]:
    """`sync` -> 0, `async-AGE` -> AGE (the max trajectory age); ValueError naming an unknown mode."""
    ages = {}
    for mode in modes:
        kind, _, age = mode.partition("-")
        if (kind, age) != ("sync", "") and not (kind == "async" and age.isdigit() and int(age) > 0):
            raise ValueError(f"unknown mode {mode!r}: sync or async-AGE")
        ages[mode] = int(age or 0)
    return ages


def plot_curves(panels: dict[str, dict[str, list[dict[str, float]]]], xs: list[tuple[str, str]], path: Path,
                line_at: float | None = None) -> None:
    """Held-out reward curves, a row per panel (title -> label -> points) and a column per x (key, label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), len(xs), figsize=(5.5 * len(xs), 4 * len(panels)), squeeze=False)
    for row, (title, curves) in enumerate(panels.items()):
        for col, (x, label) in enumerate(xs):
            ax = axes[row][col]
            for name, points in curves.items():
                ax.plot([p[x] for p in points], [p["val_reward"] for p in points], marker="o", label=name)
            if line_at is not None:
                ax.axhline(line_at, color="grey", lw=0.8, ls="--")
            ax.set(xlabel=label, ylabel="held-out reward", title=f"{title}: held-out reward vs {label}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def default_cluster_data(rollout_engine: str | None = None) -> dict[str, Any]:
    """The embedded default cluster file as a dict; `rollout_engine: vllm` swaps its rollout to vLLM's CPU
    engine with the direct gloo transfer, for the benchmarks that measure what only vLLM does (streaming,
    in-flight updates, batched LoRA adapters, pinned engine cores)."""
    import yaml

    from rlserve.cluster.config import default_cluster_file

    data = yaml.safe_load(default_cluster_file().read_text())
    if rollout_engine == "vllm":
        data["services"]["rollout"]["args"].update(engine="vllm", weight_transfer="gloo", kv_cache_gb=1)
    elif rollout_engine is not None:
        data["services"]["rollout"]["args"]["engine"] = rollout_engine
    return data
