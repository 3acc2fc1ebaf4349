"""The replay buffer and the staleness rule of the async loop.

A group (the samples of one prompt) carries the weight version `g` that
generated it. A trainer at version `v` may use it only if v - g <= max_age;
older groups are handed back as dropped, never silently discarded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


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


def is_fresh(group: Group, version: int, max_age: int) -> bool:
    """The staleness rule: usable by a trainer at `version` iff its age is within the bound."""
    return version - group.weight_version <= max_age


class ReplayBuffer:
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

    async def take(self, n: int, version: int, max_age: int) -> tuple[list[Group], list[Group]]:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._groups) >= n)
            batch, self._groups = self._groups[:n], self._groups[n:]
        fresh = [g for g in batch if is_fresh(g, version, max_age)]
        stale = [g for g in batch if not is_fresh(g, version, max_age)]
        return fresh, stale

    def snapshot(self) -> list[Group]:
        return list(self._groups)

    def restore(self, groups: list[Group]) -> None:
        self._groups = list(groups)
