"""Produced steps, and the queue that hands them from the producer to the trainer.

The queue is consumed once: the trainer takes one produced step at a time,
oldest first, and each of its groups is trained or dropped (always counted in
the ledger). It is not a replay buffer: nothing is sampled twice. The queue
also holds the producer back: step k may start generating only while the
staleness bound allows it (`staleness.py`), and the trainer moving on is what
lets it go. It is the version clock the two sides share, too: the trainer
advances it with the weight version its step published, and the producer asks
the engines for at least that version. Producer and trainer meet here only.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from rlserve.trajectories.staleness import StalenessBound
from rlserve.trajectories.trajectory import Group


@dataclass
class ProducedStep:
    """One step's groups as the producer committed them, with what the trainer reports about them."""

    step: int
    groups: list[Group]
    # timing/* and plumbing/* seconds of generating, scoring and reference-scoring them (and
    # dynamic_sampling/* with DAPO's dynamic sampling).
    metrics: dict[str, float] = field(default_factory=dict)
    # The data cursor at the step's first prompt.
    data_cursor: int = 0

    @property
    def size(self) -> int:
        return sum(g.size for g in self.groups)

    @classmethod
    def from_dict(cls, saved: dict) -> ProducedStep:
        """A step as a checkpoint saved it (steps saved before they recorded their data cursor start at their
        first group's prompt)."""
        return cls(saved["step"], [Group.from_dict(g) for g in saved["groups"]], saved["metrics"],
                   saved.get("data_cursor", min((g["prompt_index"] for g in saved["groups"]), default=0)))


def saved_steps(saved: list[dict]) -> list[ProducedStep]:
    """A checkpoint's queue. Checkpoints written before the queue held whole steps saved a flat list of
    groups, each naming its step (and its trajectory ids, no longer kept)."""
    if saved and "groups" not in saved[0]:
        by_step: dict[int, list[dict]] = {}
        for g in saved:
            by_step.setdefault(g["step"], []).append({k: v for k, v in g.items() if k not in ("step", "ids")})
        return [ProducedStep.from_dict({"step": step, "groups": groups, "metrics": {}})
                for step, groups in sorted(by_step.items())]
    return [ProducedStep.from_dict(s) for s in saved]


def summarize_errors(messages: list[str], limit: int) -> str:
    """The first `limit` distinct messages with their counts; the rest only counted."""
    counts = Counter(messages)
    shown = [f"{msg} (x{n})" if n > 1 else msg for msg, n in list(counts.items())[:limit]]
    rest = list(counts.items())[limit:]
    if rest:
        shown.append(f"{len(rest)} other messages ({sum(n for _, n in rest)} errors) not shown")
    return "; ".join(shown)


class StepQueue:
    """FIFO of produced steps between one producer and one trainer, with the producer's staleness gate and
    the weight version the trainer is at."""

    def __init__(self, bound: StalenessBound, trainer_step: int = 0, version: int = 0):
        self.bound = bound
        self.trainer_step = trainer_step
        self.version = version
        self._steps: list[ProducedStep] = []
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._steps)

    def put(self, produced: ProducedStep) -> None:
        """Synchronous, so the producer counts and queues a step with nothing in between."""
        self._steps.append(produced)
        self._wake()

    async def take(self) -> ProducedStep:
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._steps))
            return self._steps.pop(0)

    async def wait_turn(self, step: int) -> None:
        """Until step `step` may start generating: at most max_age unconsumed steps ahead of the trainer."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.bound.may_generate(step - self.trainer_step))

    def advance(self, trainer_step: int, version: int) -> None:
        """The trainer finished step `trainer_step - 1` at weight version `version`: later steps may start
        generating, from at least that version."""
        self.trainer_step, self.version = trainer_step, version
        self._wake()

    def load(self, steps: list[ProducedStep], trainer_step: int, version: int) -> None:
        """Replace the contents (a checkpoint restore, before producer and trainer start)."""
        self._steps, self.trainer_step, self.version = list(steps), trainer_step, version

    def snapshot(self) -> list[ProducedStep]:
        return list(self._steps)

    def _wake(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()
        asyncio.get_running_loop().create_task(notify())
