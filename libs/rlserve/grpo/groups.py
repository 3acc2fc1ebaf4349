"""Groups (the samples of one prompt), produced steps, and the queue that hands them to the trainer.

The queue is consumed once: the trainer takes one produced step at a time,
oldest first, and each of its groups is trained or dropped (always counted in
the ledger). It is not a replay buffer: nothing is sampled twice. The queue
also holds the producer back: step k may start generating only while the
staleness bound allows it (`staleness.py`), and the trainer moving on is what
lets it go.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from rlserve.grpo.staleness import StalenessBound


@dataclass
class Group:
    """The samples of one prompt, scored (and with reference logprobs when the KL needs them).

    Multi-turn episodes (`episodes.py`) fill the episode fields: a completion is everything after the
    prompt (the policy's turns, the environment's observations and the template's turn markers), its
    loss mask says which tokens are the policy's, and the reward is the episode's return.
    """

    prompt_index: int  # position of the prompt in the run's data order (the data cursor)
    prompt_ids: list[int]
    completions: list[list[int]]
    gen_logprobs: list[list[float]]
    rewards: list[float]
    weight_version: int  # the oldest version any token of the group was generated under
    ref_logprobs: list[list[float]] | None = None
    # The reward plug-ins' messages for the samples they failed to score (a group with any is dropped).
    reward_errors: list[str] = field(default_factory=list)
    # Per sample, what the reward functions reported about it ("FUNCTION/KEY": value; `ScoreResult.metrics`).
    reward_metrics: list[dict[str, float]] = field(default_factory=list)
    # Samples generated under more than one version (an in-flight update landed while they ran),
    # and the largest newest-minus-oldest version of any sample.
    mixed_samples: int = 0
    version_spread: int = 0
    # Multi-turn episodes: per sample, the loss mask over its completion, how it ended (done,
    # max_turns, truncated), its turns and the environment's metrics; and the [reason, message] of
    # each episode the environment failed (a group with any is dropped).
    loss_masks: list[list[bool]] | None = None
    endings: list[str] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    episode_metrics: list[dict[str, float]] = field(default_factory=list)
    env_failures: list[list[str]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.completions)

    @property
    def generated_tokens(self) -> int:
        """The policy's own tokens (an episode's observations between its turns are the environment's)."""
        if self.loss_masks is not None:
            return sum(sum(m) for m in self.loss_masks)
        return sum(len(c) for c in self.completions)


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


def summarize_errors(messages: list[str], limit: int) -> str:
    """The first `limit` distinct messages with their counts; the rest only counted."""
    counts = Counter(messages)
    shown = [f"{msg} (x{n})" if n > 1 else msg for msg, n in list(counts.items())[:limit]]
    rest = list(counts.items())[limit:]
    if rest:
        shown.append(f"{len(rest)} other messages ({sum(n for _, n in rest)} errors) not shown")
    return "; ".join(shown)


class StepQueue:
    """FIFO of produced steps between one producer and one trainer, with the producer's staleness gate."""

    def __init__(self, bound: StalenessBound, trainer_step: int = 0, steps: list[ProducedStep] | None = None):
        self.bound = bound
        self.trainer_step = trainer_step
        self._steps: list[ProducedStep] = list(steps or [])
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

    def advance(self, trainer_step: int) -> None:
        """The trainer finished step `trainer_step - 1`: later steps may start generating."""
        self.trainer_step = trainer_step
        self._wake()

    def load(self, steps: list[ProducedStep], trainer_step: int) -> None:
        """Replace the contents (a checkpoint restore, before producer and trainer start)."""
        self._steps, self.trainer_step = list(steps), trainer_step

    def snapshot(self) -> list[ProducedStep]:
        return list(self._steps)

    def _wake(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()
        asyncio.get_running_loop().create_task(notify())


def per_sample_means(samples: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Each key's mean over the samples that report it (environment or reward-function metrics), as
    `PREFIX + key`."""
    reported: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.items():
            reported.setdefault(key, []).append(value)
    return {f"{prefix}{key}": sum(v) / len(v) for key, v in reported.items()}
