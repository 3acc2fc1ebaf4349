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
        scored = self.reward(RewardInput(ep.prompt, step.assistant, ep.answer, ep.metadata))
        return StepOutput(observation=[], reward=scored.total, done=True,
                          metrics={**scored.components, **scored.metrics})


_INTEGER = re.compile(r"-?\d+")


class GuessNumber(Environment):
    """Guess the number: "higher" / "lower" until right. The number is the row's `env_args.target`
    (or its answer); `env_args.max_number` overrides the constructor's range for that row.

    The episode's state is the range the answers so far leave open ([low, high]). A guess outside it
    ignored the feedback: it counts in the `ignored_feedback` metric and, with `feedback_penalty`,
    costs that much reward (shaping that rewards using the feedback turn by turn, not only at the end).
    """

    name = "guess_number"

    def __init__(self, max_number: int = 100, discount: float = 0.9, feedback_penalty: float = 0.0):
        if isinstance(max_number, bool) or not isinstance(max_number, int) or max_number < 1:
            raise ValueError(f"max_number: must be an integer >= 1, got {max_number!r}")
        if isinstance(discount, bool) or not isinstance(discount, (int, float)) or not 0 < discount <= 1:
            raise ValueError(f"discount: must be in (0, 1], got {discount!r}")
        if isinstance(feedback_penalty, bool) or not isinstance(feedback_penalty, (int, float)) \
                or not 0 <= feedback_penalty <= 1:
            raise ValueError(f"feedback_penalty: must be in [0, 1], got {feedback_penalty!r}")
        self.max_number, self.discount = max_number, float(discount)
        self.feedback_penalty = float(feedback_penalty)

    def _game(self, step: StepInput) -> tuple[int, int]:
        args: dict[str, Any] = step.episode.env_args
        high = int(args.get("max_number", self.max_number))
        target = int(args["target"]) if "target" in args else int(step.episode.answer)
        if not 1 <= target <= high:
            raise ValueError(f"target {target} is outside 1..{high}")
        return target, high

    def step(self, step: StepInput) -> StepOutput:
        target, high = self._game(step)
        state = step.state or {"low": 1, "high": high, "ignored": 0}
        found = _INTEGER.search(step.assistant)
        guess = int(found.group()) if found and len(found.group()) <= 12 else None
        valid = guess is not None and 1 <= guess <= high
        ignored = valid and step.turn > 1 and not state["low"] <= guess <= state["high"]
        state = {**state, "ignored": state["ignored"] + ignored}
        penalty = self.feedback_penalty * ignored
        metrics = {"success": 0.0, "turns": float(step.turn), "invalid": 0.0 if valid else 1.0,
                   "ignored_feedback": float(state["ignored"])}
        if guess == target:
            return StepOutput([], self.discount ** (step.turn - 1) - penalty, True, {**metrics, "success": 1.0}, state)
        if not valid:
            text = f"answer with a whole number from 1 to {high}."
        elif guess < target:
            text, state = "higher", {**state, "low": max(state["low"], guess + 1)}
        else:
            text, state = "lower", {**state, "high": min(state["high"], guess - 1)}
        return StepOutput([{"role": "user", "content": text}], -penalty, False, metrics, state)
