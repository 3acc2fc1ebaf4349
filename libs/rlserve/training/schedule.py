"""Learning-rate schedule: linear warm-up, then constant or cosine decay."""

from __future__ import annotations

import math

from rlserve.config.policy import SchedulerCfg


def lr_factor(step: int, cfg: SchedulerCfg, total_steps: int) -> float:
    """Multiplier of the base lr at `step` (0-based), for torch.optim.lr_scheduler.LambdaLR."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
