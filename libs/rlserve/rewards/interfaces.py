"""The reward plug-in contract.

A reward function scores one completion. Plug-ins are classes (constructed
with the `args` of their spec as keyword arguments) or plain functions; both
are then called with one positional `RewardInput` and return a
`RewardOutput` or a float.
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


class RewardFunction(ABC):
    name: str = "reward"

    @abstractmethod
    def __call__(self, item: RewardInput) -> RewardOutput: ...
