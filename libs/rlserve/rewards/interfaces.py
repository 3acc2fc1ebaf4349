"""The reward plug-in contract.

A reward function scores one completion. Plug-ins are classes (constructed
with the `args` of their spec as keyword arguments) or plain functions; both
are then called with one positional `RewardInput` and return a
`RewardOutput` or a float. A function backed by a model (`reward_model`,
`llm_judge`) is a `BatchRewardFunction`: the service hands it a whole Score
request at once, so one forward pass scores many completions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RewardInput:
    prompt: str
    completion: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardOutput:
    score: float
    info: dict[str, Any] = field(default_factory=dict)
    # Numbers the step's metrics average over its samples, as `reward/FUNCTION/KEY` (a judge's
    # unparsable answers, say): what an operator should see without reading every item's info.
    metrics: dict[str, float] = field(default_factory=dict)


class RewardFunction(ABC):
    name: str = "reward"

    @abstractmethod
    def __call__(self, item: RewardInput) -> RewardOutput: ...


class BatchRewardFunction(RewardFunction):
    """A function that scores a batch at once. If `score_batch` raises, every item of the batch is an
    error of this function (the service answers each with SCORE_STATUS_ERROR, as for one item)."""

    @abstractmethod
    def score_batch(self, items: list[RewardInput]) -> list[RewardOutput]:
        """One output per item, in order."""

    def __call__(self, item: RewardInput) -> RewardOutput:
        return self.score_batch([item])[0]
