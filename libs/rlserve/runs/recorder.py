"""The run directory: spec, state, events, metrics (JSONL + TensorBoard) and the reward plot.

    <runs_dir>/<run_id>/
      spec.yaml          the resolved spec (every default filled in)
      run.json           state, step, version, ledger, error (rewritten on change)
      events.jsonl       every event of WatchRun, one per line (reloaded by a restarted coordinator)
      metrics.jsonl      one line per step (rewound to the checkpoint when a run resumes)
      tensorboard/       the same metrics as TensorBoard events
      reward_curve.png   train and held-out reward per step (at the end)
      sft_model/         the SFT warm-start policy (when sft.enabled)
      checkpoints/step_NNNNNN/{learner/, coordinator.json}
      final_model/       the trained policy as an HF folder
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class Recorder:
    def __init__(self, run_dir: Path, tensorboard: bool):
        self.run_dir = run_dir
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._tensorboard = tensorboard
        self._tb = None  # opened at the first metrics, so merely loading a run writes nothing
        self._purge_step: int | None = None  # set by rewind: TensorBoard hides earlier events from here on

    def write_json(self, name: str, data: Any) -> None:
        tmp = self.run_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        tmp.replace(self.run_dir / name)

    def append(self, name: str, record: dict) -> None:
        with open(self.run_dir / name, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def read(self, name: str) -> list[dict]:
        """The records of a JSONL file (a torn last line, from a crash while writing, is skipped)."""
        path = self.run_dir / name
        if not path.is_file():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.append("metrics.jsonl", {"step": step, **metrics})
        if self._tensorboard and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=self._purge_step)
            self._purge_step = None
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def rewind(self, step: int) -> None:
        """Forget the metrics of steps after `step` (a resumed run redoes them, so each step is kept once).

        metrics.jsonl is rewritten without them; TensorBoard's own mechanism does the same for its
        event files: the next writer opens with `purge_step`, and TensorBoard then hides every
        earlier event at or after that step.
        """
        kept = [row for row in self.read("metrics.jsonl") if row["step"] <= step]
        tmp = self.run_dir / ".metrics.jsonl.tmp"
        tmp.write_text("".join(json.dumps(row, default=str) + "\n" for row in kept))
        tmp.replace(self.run_dir / "metrics.jsonl")
        self.close()
        self._purge_step = step + 1

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def plot(self) -> Path | None:
        """Train reward and held-out reward against the step, from metrics.jsonl (a supervised run without
        rewards: its training loss)."""
        rows = self.read("metrics.jsonl")
        if not rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        curves = (("reward/mean", "train reward (sampled)"), ("val/reward", "held-out reward (greedy)"))
        ylabel = "reward"
        if not any(key in r for r in rows for key, _ in curves):
            curves, ylabel = (("loss/total", "training loss"),), "loss"
        for key, label in curves:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key.startswith("val") else None, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        out = self.run_dir / "reward_curve.png"
        fig.tight_layout()
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out
