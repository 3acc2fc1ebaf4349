"""Where an attempt is: written by the step loop, and by setup and restore before the steps start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class LoopState:
    # The policy the learner is configured on: the model, or an RL run's SFT warm start (also its reference).
    init_model: Path
    step: int = 0  # steps finished (trained or skipped)
    version: int = 0  # the learner's weight version
    initial_val: float | None = None
    checkpoints_saved: int = 0
