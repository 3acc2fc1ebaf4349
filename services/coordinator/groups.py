"""Groups (the samples of one prompt) and the FIFO that hands them from producer to trainer.

The queue is consumed once: the trainer takes the oldest groups first and
each group leaves the queue when taken (trained or dropped, always counted in
the ledger). It is not a replay buffer: nothing is sampled twice.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from services.coordinator.staleness import StalenessBound


@dataclass
class Group:
    """The samples of one prompt, scored (and with reference logprobs when the KL needs them)."""

    prompt_index: int  # position of the prompt in the run's data order (the data cursor)
    prompt_ids: list[int]
    completions: list[list[int]]
    gen_logprobs: list[list[float]]
    rewards: list[float]
    weight_version: int  # the oldest version any token of the group was generated under
    step: int  # the training step it was generated for
    ref_logprobs: list[list[float]] | None = None
    # The reward plug-ins' messages for the samples they failed to score (a group with any is dropped).
    reward_errors: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    # Samples generated under more than one version (an in-flight update landed while they ran),
    # and the largest newest-minus-oldest version of any sample.
    mixed_samples: int = 0
    version_spread: int = 0

    @property
    def size(self) -> int:
        return len(self.completions)


def summarize_errors(messages: list[str], limit: int) -> str:
    """The first `limit` distinct messages with their counts; the rest only counted."""
    counts = Counter(messages)
    shown = [f"{msg} (x{n})" if n > 1 else msg for msg, n in list(counts.items())[:limit]]
    rest = list(counts.items())[limit:]
    if rest:
        shown.append(f"{len(rest)} other messages ({sum(n for _, n in rest)} errors) not shown")
    return "; ".join(shown)


class GroupQueue:
    """FIFO of groups; `take` waits for n groups and splits them into fresh and stale (one consumer)."""

    def __init__(self, groups: list[Group] | None = None) -> None:
        self._groups: list[Group] = list(groups or [])
        self._grew = asyncio.Event()

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, groups: list[Group]) -> None:
        """Synchronous, so the producer counts and queues a step's groups with nothing in between."""
        self._groups.extend(groups)
        self._grew.set()

    async def take(self, n: int, version: int, bound: StalenessBound) -> tuple[list[Group], list[Group]]:
        while len(self._groups) < n:
            self._grew.clear()
            await self._grew.wait()
        batch, self._groups = self._groups[:n], self._groups[n:]
        fresh = [g for g in batch if bound.is_fresh(version, g.weight_version)]
        stale = [g for g in batch if not bound.is_fresh(version, g.weight_version)]
        return fresh, stale

    def snapshot(self) -> list[Group]:
        return list(self._groups)
