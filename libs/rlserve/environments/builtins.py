"""Built-in environments.

- `single_turn`: reward functions as an environment. The policy answers once,
  the functions score the answer and the episode is done: a run with it
  trains exactly what the reward service's `Score` would score.
- `guess_number`: a feedback game. The environment holds a number in
  1..max_number; each turn the policy guesses and hears "higher" or "lower"
  until it is right (reward `discount ** (turns - 1)`, so fewer turns score
  more) or the caller's turn limit ends the episode (reward 0).
"""

from __future__ import annotations

import re
from typing import Any

from rlserve.environments.interfaces import Environment, StepInput, StepOutput
from rlserve.rewards.interfaces import RewardInput
from rlserve.rewards.loader import CombinedReward


class SingleTurn(Environment):
    """Done after one step, scored by reward functions (the run's, or the service's deployed default)."""

    name = "single_turn"

    def __init__(self, reward: CombinedReward):
        self.reward = reward

    def step(self, step: StepInput) -> StepOutput:
        ep = step.episode
        score, components, _ = self.reward(RewardInput(ep.prompt, step.assistant, ep.answer, ep.metadata))
        return StepOutput(observation=[], reward=score, done=True, metrics=components)


_INTEGER = re.compile(r"-?\d+")


class GuessNumber(Environment):
    """Guess the number: "higher" / "lower" until right. The number is the row's `env_args.target`
    (or its answer); `env_args.max_number` overrides the constructor's range for that row."""

    name = "guess_number"

    def __init__(self, max_number: int = 100, discount: float = 0.9):
        if isinstance(max_number, bool) or not isinstance(max_number, int) or max_number < 1:
            raise ValueError(f"max_number: must be an integer >= 1, got {max_number!r}")
        if isinstance(discount, bool) or not isinstance(discount, (int, float)) or not 0 < discount <= 1:
            raise ValueError(f"discount: must be in (0, 1], got {discount!r}")
        self.max_number, self.discount = max_number, float(discount)

    def _game(self, step: StepInput) -> tuple[int, int]:
        args: dict[str, Any] = step.episode.env_args
        high = int(args.get("max_number", self.max_number))
        target = int(args["target"]) if "target" in args else int(step.episode.answer)
        if not 1 <= target <= high:
            raise ValueError(f"target {target} is outside 1..{high}")
        return target, high

    def step(self, step: StepInput) -> StepOutput:
        target, high = self._game(step)
        found = _INTEGER.search(step.assistant)
        guess = int(found.group()) if found and len(found.group()) <= 12 else None
        valid = guess is not None and 1 <= guess <= high
        metrics = {"success": 0.0, "turns": float(step.turn), "invalid": 0.0 if valid else 1.0}
        if guess == target:
            return StepOutput([], self.discount ** (step.turn - 1), True, {**metrics, "success": 1.0})
        if not valid:
            text = f"answer with a whole number from 1 to {high}."
        else:
            text = "higher" if guess < target else "lower"
        return StepOutput([{"role": "user", "content": text}], 0.0, False, metrics)
