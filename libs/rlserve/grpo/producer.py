"""The producer: generates each step's groups as soon as the staleness bound allows.

Step k's prompts are taken from the data cursor, generated, scored and (with
a KL penalty) reference-scored (or, with an environment, played as episodes of
several turns: `episodes.py`), then committed to the `StepQueue` whole: the
ledger counts them and the trainer may take them. With max_age 0 a step
waits for the previous one to be trained (synchronous on-policy GRPO); with
max_age >= 1 generation of step k overlaps training of step k - 1.

Streaming (`grpo.async_grpo.streaming`) sends small requests
(`prompts_per_request` prompts, at most `max_prompts_in_flight` at once),
scores each as soon as its samples finish, and starts step k + 1's prompts
while step k's last groups still generate. Steps are still committed whole
and in order, so checkpoints and the data cursor stay per step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from rlserve.data.tasks import Example
from rlserve.grpo.episodes import episode_groups
from rlserve.grpo.groups import ProducedStep, StepQueue
from rlserve.grpo.rollouts import BatchTimings, rollout_groups
from rlserve.grpo.services import RunServices
from rlserve.grpo.state import ProducerState, RunInputs
from rlserve.runs.record import Run
from rlserve.v1 import coordinator_pb2 as pb


class Producer:
    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, state: ProducerState, queue: StepQueue,
                 reference_model: Path, progress: Callable[[], None]):
        self.inputs, self.run, self.services = inputs, run, services
        self.state, self.queue = state, queue
        self.reference_model = reference_model
        self.progress = progress
        # One scored completion per sample, or (env.enabled) an episode of several turns per sample.
        self.rollout = episode_groups if inputs.spec.env.enabled else rollout_groups

    async def run_steps(self) -> None:
        """Produce every step up to grpo.max_num_steps (returns when the last one is committed)."""
        if self.inputs.spec.grpo.async_grpo.streaming:
            await self._stream()
            return
        spec = self.inputs.spec
        while self.state.produced_steps < spec.grpo.max_num_steps:
            step = self.state.produced_steps
            await self.queue.wait_turn(step)
            first = self.state.sampler.position
            examples = self.state.sampler.take(spec.grpo.num_prompts_per_step)
            groups, reward_version, timings = await self.rollout(
                self.services, self.inputs, examples, first, step, self.run.version, self.reference_model)
            self._commit(ProducedStep(step, groups, timings.metrics()), reward_version, timings)

    def _commit(self, produced: ProducedStep, reward_version: str, timings: BatchTimings) -> None:
        """Count and queue one step. Synchronous, so a checkpoint sees both or neither."""
        state = self.state
        self.run.ledger.generate(produced.size)
        if state.reward_version is not None and reward_version != state.reward_version:
            self.run.emit(pb.EVENT_KIND_REWARD_SWAP,
                          f"reward service changed: {state.reward_version} -> {reward_version}")
        state.reward_version = reward_version
        state.activity.update(timings.activity)
        state.produced_steps += 1
        self.queue.put(produced)
        self.run.save()
        self.progress()

    async def _stream(self) -> None:
        spec = self.inputs.spec
        per_request = spec.grpo.async_grpo.prompts_per_request
        limit = asyncio.Semaphore(max(1, spec.grpo.async_grpo.max_prompts_in_flight // per_request))

        async def one(examples: list[Example], first: int, step: int, offset: int):
            async with limit:
                return await self.rollout(self.services, self.inputs, examples, first + offset, step,
                                            self.run.version, self.reference_model, offset=offset)

        async def stream_step(step: int, examples: list[Example], first: int, before: asyncio.Task | None) -> None:
            parts = await asyncio.gather(*(one(examples[i:i + per_request], first, step, i)
                                           for i in range(0, len(examples), per_request)))
            if before is not None:
                await before
            timings = BatchTimings()
            for _, _, t in parts:
                timings.add(t)
            groups = [g for part_groups, _, _ in parts for g in part_groups]
            self._commit(ProducedStep(step, groups, timings.metrics()), parts[-1][1], timings)

        running: list[asyncio.Task] = []
        try:
            for step in range(self.state.produced_steps, spec.grpo.max_num_steps):
                await self._wait_turn(step, running)
                first = self.state.sampler.position
                examples = self.state.sampler.take(spec.grpo.num_prompts_per_step)
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
