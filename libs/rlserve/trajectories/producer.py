"""The producer: generates each step's groups as soon as the staleness bound allows.

Step k's prompts are taken from the data cursor and played as groups of
trajectories (`rollout.py`: generated and scored, or played as episodes of
several turns, and reference-scored when the KL term needs it), then committed
to the `StepQueue` whole: the ledger counts them and the trainer may take them. With max_age 0 a step
waits for the previous one to be trained (synchronous on-policy GRPO); with
max_age >= 1 generation of step k overlaps training of step k - 1.

Streaming (`grpo.async_grpo.streaming`) sends small requests
(`prompts_per_request` prompts, at most `max_prompts_in_flight` at once),
scores each as soon as its samples finish, and starts step k + 1's prompts
while step k's last groups still generate. Steps are still committed whole
and in order, so checkpoints and the data cursor stay per step.

Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476; NeMo-RL's
`grpo.use_dynamic_sampling`): a step generates batches of
`batch_multiplier x num_prompts_per_step` prompts until it holds
`num_prompts_per_step` groups whose task rewards differ, at most
`dynamic_sampling_max_gen_batches` batches. Groups whose rewards are all
equal are dropped as `dynamic_sampling`, groups beyond the step's
`num_prompts_per_step` as `dynamic_sampling_surplus` (both counted in the
ledger when the step is committed); a step that reaches the bound short of
its batch trains what it has, with a WARNING. Each batch is generated under
the newest weights (and streamed, when streaming), and its groups are tagged
with their own versions, so the staleness bound holds for refills as for the
first batch. A step takes its prompts in order, so the next step starts once
this one has its batch (generation still overlaps training).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlserve.algorithms.dynamic_sampling import zero_variance_groups
from rlserve.data.dataset import PromptSampler
from rlserve.data.tasks import Example
from rlserve.loop.inputs import RunInputs
from rlserve.loop.services import RunServices
from rlserve.runs.record import Run
from rlserve.trajectories.generation import Played, Plays
from rlserve.trajectories.queue import ProducedStep, StepQueue
from rlserve.trajectories.rollout import play
from rlserve.trajectories.timings import Activity, BatchTimings
from rlserve.trajectories.trajectory import Group
from rlserve.v1 import coordinator_pb2 as pb

# Ledger reasons of dynamic sampling's drops.
FILTERED = "dynamic_sampling"
SURPLUS = "dynamic_sampling_surplus"


@dataclass
class ProducerState:
    """Written only by the producer (and by a checkpoint restore before it starts). Steps take prompts at
    the data cursor in order: num_prompts_per_step each, or with dynamic sampling as many generation
    batches as the step needs."""

    sampler: PromptSampler
    produced_steps: int = 0  # steps whose groups are in the queue or trained
    data_cursor: int = 0  # the data cursor after the last committed step's prompts
    reward_version: str | None = None
    activity: Activity = field(default_factory=dict)  # the newest activity of each rollout replica


@dataclass
class StepRollouts:
    """A step's groups before it is committed: those it trains, and those dynamic sampling drops."""

    step: int
    first: int  # the data cursor at its first prompt
    end: int  # and after its last
    groups: list[Group] = field(default_factory=list)
    reward_version: str = ""
    timings: BatchTimings = field(default_factory=BatchTimings)
    drops: dict[str, list[Group]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class Producer:
    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, state: ProducerState, queue: StepQueue,
                 reference_model: Path, progress: Callable[[], None]):
        self.inputs, self.run, self.services = inputs, run, services
        self.state, self.queue = state, queue
        self.reference_model = reference_model
        self.progress = progress
        streaming = inputs.spec.grpo.async_grpo
        self.limit = asyncio.Semaphore(max(1, streaming.max_prompts_in_flight // streaming.prompts_per_request))

    def _play(self, examples: list[Example], first: int, step: int, offset: int) -> Coroutine[Any, Any, Played]:
        """Play `examples` (taken at `first`, at `offset` within step `step`) from at least the version the
        trainer is at."""
        grpo = self.inputs.spec.grpo
        return play(self.services, self.inputs, Plays(
            examples, first, str(step), grpo.seed * 1_000_003 + step, offset, grpo.num_generations_per_prompt,
            False, self.queue.version), self.reference_model)

    async def run_steps(self) -> None:
        """Produce every step up to grpo.max_num_steps (returns when the last one is committed)."""
        grpo = self.inputs.spec.grpo
        if grpo.async_grpo.streaming and not grpo.use_dynamic_sampling:
            await self._stream()
            return
        while self.state.produced_steps < grpo.max_num_steps:
            step = self.state.produced_steps
            await self.queue.wait_turn(step)
            if grpo.use_dynamic_sampling:
                self._commit(await self._sample_dynamically(step))
                continue
            first = self.state.sampler.position
            examples = self.state.sampler.take(grpo.num_prompts_per_step)
            played = await self._generate(examples, first, step, 0)
            self._commit(StepRollouts(step, first, self.state.sampler.position, played.groups, played.version,
                                      played.timings))

    async def _generate(self, examples: list[Example], first: int, step: int, offset: int) -> Played:
        """Play `examples` (taken at `first`, at `offset` within the step): one request, or streaming
        requests of `prompts_per_request` prompts."""
        async_cfg = self.inputs.spec.grpo.async_grpo
        if not async_cfg.streaming:
            return await self._play(examples, first, step, offset)
        per_request = async_cfg.prompts_per_request

        async def one(i: int) -> Played:
            async with self.limit:
                return await self._play(examples[i:i + per_request], first + i, step, offset + i)

        parts = await asyncio.gather(*(one(i) for i in range(0, len(examples), per_request)))
        timings = BatchTimings()
        for part in parts:
            timings.add(part.timings)
        return Played([g for part in parts for g in part.groups], parts[-1].version, timings)

    async def _sample_dynamically(self, step: int) -> StepRollouts:
        """DAPO's dynamic sampling: generation batches until the step holds num_prompts_per_step groups
        whose task rewards differ (or the bound on batches is reached)."""
        grpo = self.inputs.spec.grpo
        wanted, size = grpo.num_prompts_per_step, grpo.gen_batch_prompts
        first = self.state.sampler.position
        out = StepRollouts(step, first, first)
        signal: list[Group] = []
        errored: list[Group] = []  # the trainer drops them, quoting the plug-in's messages
        filtered: list[Group] = []
        batches = 0
        while len(signal) < wanted and batches < grpo.dynamic_sampling_max_gen_batches:
            start = self.state.sampler.position
            examples = self.state.sampler.take(size)
            played = await self._generate(examples, start, step, start - first)
            out.reward_version = played.version
            out.timings.add(played.timings)
            batches += 1
            scored = [g for g in played.groups if not g.reward_errors and not g.env_failures]
            errored += [g for g in played.groups if g.reward_errors or g.env_failures]
            equal = zero_variance_groups(torch.tensor([g.rewards for g in scored])).tolist() if scored else []
            filtered += [g for g, e in zip(scored, equal) if e]
            signal += [g for g, e in zip(scored, equal) if not e]
        out.end = self.state.sampler.position
        out.groups = sorted(signal[:wanted] + errored, key=lambda g: g.prompt_index)
        out.drops = {FILTERED: filtered, SURPLUS: signal[wanted:]}
        generated = len(signal) + len(errored) + len(filtered)
        out.metrics = {
            "dynamic_sampling/num_gen_batches": float(batches),
            "dynamic_sampling/filtered_fraction": len(filtered) / generated,
            "dynamic_sampling/discarded_valid_groups": float(max(0, len(signal) - wanted)),
            "dynamic_sampling/groups_short": float(max(0, wanted - len(signal))),
        }
        if len(signal) < wanted:
            self.run.emit(pb.EVENT_KIND_WARNING, (
                f"step {step + 1}: dynamic sampling reached grpo.dynamic_sampling_max_gen_batches ({batches} "
                f"generation batches of {size} prompts) with {len(signal)} of {wanted} groups whose rewards differ "
                f"({len(filtered)} filtered); the step trains those"))
        return out

    def _commit(self, rollouts: StepRollouts) -> None:
        """Count and queue one step (its drops counted too). Synchronous, so a checkpoint sees all or nothing."""
        state = self.state
        every = rollouts.groups + [g for groups in rollouts.drops.values() for g in groups]
        produced = ProducedStep(rollouts.step, rollouts.groups, {
            **rollouts.timings.metrics(), **rollouts.metrics,
            "usage/generated_tokens": float(sum(g.generated_tokens for g in every))}, rollouts.first)
        self.run.count_generated(sum(g.size for g in every))
        for reason, groups in rollouts.drops.items():
            if groups:
                n = sum(g.size for g in groups)
                self.run.drop(reason, n, f"step {rollouts.step + 1}: dropped {len(groups)} groups ({n} "
                                         f"trajectories): {reason}")
        if state.reward_version is not None and rollouts.reward_version != state.reward_version:
            self.run.emit(pb.EVENT_KIND_REWARD_SWAP,
                          f"reward service changed: {state.reward_version} -> {rollouts.reward_version}")
        state.reward_version = rollouts.reward_version
        state.activity.update(rollouts.timings.activity)
        state.produced_steps += 1
        state.data_cursor = rollouts.end
        self.queue.put(produced)
        self.run.save()
        self.progress()

    async def _stream(self) -> None:
        """Streaming without dynamic sampling: step k + 1's prompts go out while step k's tail generates."""
        spec = self.inputs.spec
        prompts = spec.grpo.num_prompts_per_step

        async def stream_step(step: int, examples: list[Example], first: int, before: asyncio.Task | None) -> None:
            played = await self._generate(examples, first, step, 0)
            if before is not None:
                await before
            self._commit(StepRollouts(step, first, first + prompts, played.groups, played.version, played.timings))

        running: list[asyncio.Task] = []
        try:
            for step in range(self.state.produced_steps, spec.grpo.max_num_steps):
                await self._wait_turn(step, running)
                first = self.state.sampler.position
                examples = self.state.sampler.take(prompts)
                running.append(asyncio.create_task(stream_step(step, examples, first,
                                                               running[-1] if running else None)))
            for task in running:
                await task
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _wait_turn(self, step: int, running: list[asyncio.Task]) -> None:
        """Wait until step `step` may generate; a failed step in `running` raises at once."""
        gate = asyncio.create_task(self.queue.wait_turn(step))
        try:
            while not gate.done():
                done, _ = await asyncio.wait([gate, *running], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not gate and task.exception() is not None:
                        raise task.exception()
                running[:] = [t for t in running if not t.done()]
        finally:
            gate.cancel()
