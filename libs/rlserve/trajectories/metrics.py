"""What a step's trajectories say about the run: rewards, lengths, how episodes ended, engine idleness.

Metric names are namespaced (`reward/`, `completion/`, `episode/`, `engine/`, `usage/`); every mean is
over the trajectories that report the value.
"""

from __future__ import annotations

import math

import torch

from rlserve.trajectories.timings import Activity
from rlserve.trajectories.trajectory import ENDINGS, Group


def per_sample_means(samples: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Each key's mean over the samples that report it (environment or reward-function metrics), as
    `PREFIX + key`."""
    reported: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.items():
            reported.setdefault(key, []).append(value)
    return {f"{prefix}{key}": sum(v) / len(v) for key, v in reported.items()}


def reward_metrics(rewards: torch.Tensor, groups: list[Group]) -> dict[str, float]:
    """The rewards' spread, and the means of what the reward functions reported per sample
    (`reward/FUNCTION/KEY`, e.g. a judge's unparsable answers)."""
    if not rewards.numel():
        return {"reward/mean": math.nan, "reward/std": 0.0, "reward/max": math.nan}
    out = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
           "reward/max": rewards.max().item()}
    return {**out, **per_sample_means([t.reward_metrics for g in groups for t in g.trajectories], "reward/")}


def completion_metrics(groups: list[Group]) -> dict[str, float]:
    """The policy's tokens per trajectory (over all its turns): RL batches are long-tailed, and the longest
    sample sets a synchronous step's pace; and the share the token limits cut."""
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories:
        return {}
    lengths = [t.policy_tokens for t in trajectories]
    return {"completion/tokens_mean": sum(lengths) / len(lengths), "completion/tokens_max": float(max(lengths)),
            "completion/clipped_fraction": sum(t.ending == "truncated" for t in trajectories) / len(trajectories)}


def episode_metrics(groups: list[Group], prefix: str = "episode/") -> dict[str, float]:
    """How episodes ended, their turns, their context (observation and marker) tokens, and what their
    environment reported last."""
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories:
        return {}
    out = {f"{prefix}{e}_fraction": sum(t.ending == e for t in trajectories) / len(trajectories) for e in ENDINGS}
    out[f"{prefix}turns_mean"] = sum(t.turns for t in trajectories) / len(trajectories)
    out[f"{prefix}context_tokens_mean"] = sum(len(t.tokens) - t.policy_tokens for t in trajectories) / len(trajectories)
    return {**out, **per_sample_means([t.env_metrics for t in trajectories], f"{prefix}env/")}


def engine_idle(seen: Activity, before: Activity, own_tokens: float | None = None) -> dict[str, float]:
    """The rollout engines' idle share between two marks (replicas seen at both), the part of it
    weight updates held them, and their busy seconds: the run's generation device-seconds, or with
    `own_tokens` (a run sharing the engines with others) its share of them by the tokens it generated
    of all the engines generated meanwhile."""
    up, idle, paused, tokens = (sum(seen[r][i] - before[r][i] for r in seen if r in before) for i in range(4))
    if up <= 0:
        return {}
    share = 1.0 if own_tokens is None or tokens <= 0 else min(1.0, own_tokens / tokens)
    return {"engine/idle_fraction": idle / up, "engine/paused_fraction": paused / up,
            "usage/generation_device_s": (up - idle) * share}
