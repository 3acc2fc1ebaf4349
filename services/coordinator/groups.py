"""Groups (the samples of one prompt) and the FIFO that hands them from producer to trainer.

The queue is consumed once: the trainer takes the oldest groups first and
each group leaves the queue when taken (trained or dropped, always counted in
the ledger). It is not a replay buffer: nothing is sampled twice.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.coordinator.staleness import StalenessBound


@dataclass
class Group:
    """The samples of one prompt, scored (and with reference logprobs when the KL needs them)."""

    prompt_index: int
    prompt_ids: list[int]
    completions: list[list[int]]
    gen_logprobs: list[list[float]]
    rewards: list[float]
    weight_version: int
    step: int  # the training step it was generated for
    ref_logprobs: list[list[float]] | None = None
    reward_errors: int = 0
    ids: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.completions)


class GroupQueue:
    """FIFO of groups; `take` waits for n groups and splits them into fresh and stale."""

    def __init__(self) -> None:
        self._groups: list[Group] = []
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._groups)

    async def put(self, groups: list[Group]) -> None:
        async with self._changed:
            self._groups.extend(groups)
            self._changed.notify_all()

    async def take(self, n: int, version: int, bound: StalenessBound) -> tuple[list[Group], list[Group]]:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._groups) >= n)
            batch, self._groups = self._groups[:n], self._groups[n:]
        fresh = [g for g in batch if bound.is_fresh(version, g.weight_version)]
        stale = [g for g in batch if not bound.is_fresh(version, g.weight_version)]
        return fresh, stale

    def snapshot(self) -> list[Group]:
        return list(self._groups)

    def restore(self, groups: list[Group]) -> None:
        self._groups = list(groups)
