"""Shared bits of the benchmarks: timing, a results table, and the JSON record."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench-results"


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
