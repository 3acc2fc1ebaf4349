"""Helpers for tests that play trajectories directly (not through a whole run)."""

from __future__ import annotations

from rlserve.loop.inputs import RunInputs
from rlserve.trajectories.generation import Plays


def first_step(inputs: RunInputs, examples: list, first_index: int = 0) -> Plays:
    """What the producer asks for at a run's first step: every example played `num_generations_per_prompt`
    times, sampled (not greedy), from version 0."""
    grpo = inputs.spec.grpo
    return Plays(examples, first_index, "0", grpo.seed * 1_000_003, 0, grpo.num_generations_per_prompt, False, 0)
