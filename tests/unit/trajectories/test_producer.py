"""Producing steps: small streaming requests with bounded concurrency, steps committed whole and in
order, the next step's prompts out while the current step's tail still generates, and the staleness
gate holding the producer back until the trainer moves."""

from __future__ import annotations

import asyncio

import pytest

from rlserve.data.dataset import PromptSampler
from rlserve.trajectories.producer import Producer, ProducerState
from rlserve.trajectories.queue import StepQueue
from rlserve.trajectories.staleness import StalenessBound
from tests.support.fake_services import FakeServices

PROMPTS, GENERATIONS, STEPS, LIMIT = 4, 4, 3, 3


def producer(make_run, services: FakeServices, max_age: int, per_request: int = 1) -> Producer:
    run, inputs = make_run(grpo={"max_num_steps": STEPS, "async_grpo": {
        "enabled": True, "max_trajectory_age_steps": max_age, "streaming": True, "max_prompts_in_flight": LIMIT,
        "prompts_per_request": per_request}})
    state = ProducerState(PromptSampler(list(inputs.train), inputs.spec.data.seed))
    return Producer(inputs, run, services, state, StepQueue(StalenessBound(max_age)), inputs.model_path,
                    lambda: None)


def offsets(services: FakeServices, seed: int) -> list[tuple[int, int]]:
    """(step + offset in the step, prompts) of each Generate request: the loop seeds the request at
    offset i of step k with seed * 1_000_003 + k + i."""
    return [(req.sampling.seed - seed * 1_000_003, len(req.prompts)) for req in services.calls.generate]


def test_steps_are_committed_whole_in_order_with_bounded_concurrency(make_run):
    services = FakeServices(generate_delay_s=0.02)
    p = producer(make_run, services, max_age=STEPS)
    asyncio.run(p.run_steps())
    queued = p.queue.snapshot()
    assert [s.step for s in queued] == list(range(STEPS)) and p.state.produced_steps == STEPS
    assert [g.prompt_index for s in queued for g in s.groups] == list(range(STEPS * PROMPTS))
    assert p.run.ledger.generated == STEPS * PROMPTS * GENERATIONS
    assert len(services.calls.generate) == STEPS * PROMPTS
    assert services.calls.peak == LIMIT  # bounded, and busy up to the bound (steps overlap)
    assert all(s.metrics["timing/generate_s"] > 0 for s in queued)


def test_requests_carry_several_prompts_at_their_offsets(make_run):
    services = FakeServices()
    p = producer(make_run, services, max_age=STEPS, per_request=3)
    asyncio.run(p.run_steps())
    seed = p.inputs.spec.grpo.seed
    assert sorted(offsets(services, seed)) == sorted((s + i, n) for s in range(STEPS) for i, n in ((0, 3), (3, 1)))
    assert [g.prompt_index for s in p.queue.snapshot() for g in s.groups] == list(range(STEPS * PROMPTS))


def test_the_bound_holds_back_the_next_step_until_the_trainer_moves(make_run):
    services = FakeServices()
    p = producer(make_run, services, max_age=0)

    async def main():
        producing = asyncio.create_task(p.run_steps())
        while p.state.produced_steps < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert len(services.calls.generate) == PROMPTS  # step 1 waits for the trainer
        p.queue.advance(STEPS, version=0)
        await producing

    asyncio.run(main())
    assert p.state.produced_steps == STEPS


def test_a_failed_request_ends_the_producer(make_run):
    class Down(FakeServices):
        async def generate(self, req):
            raise RuntimeError("rollout down")

    with pytest.raises(RuntimeError, match="rollout down"):
        asyncio.run(producer(make_run, Down(), max_age=0).run_steps())
