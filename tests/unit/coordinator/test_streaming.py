"""Streaming production: small requests, bounded concurrency, steps committed whole and in order,
the next step's prompts out while the current step's tail still generates; per-sample version runs."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from rlserve.config import RunSpec
from rlserve.data.dataset import PromptSampler
from rlserve.data.tasks import Example
from rlserve.v1 import rollout_pb2
from services.coordinator import loop
from services.coordinator.groups import Group, GroupQueue
from services.coordinator.ledger import Ledger
from services.coordinator.rollouts import BatchTimings, sample_versions
from services.coordinator.staleness import StalenessBound

PROMPTS_PER_STEP, STEPS, LIMIT = 4, 3, 3


def context(max_age: int, per_request: int = 1) -> SimpleNamespace:
    spec = RunSpec.model_validate({"grpo": {
        "num_prompts_per_step": PROMPTS_PER_STEP, "max_num_steps": STEPS,
        "async_grpo": {"enabled": True, "max_trajectory_age_steps": max_age, "streaming": True,
                       "max_prompts_in_flight": LIMIT, "prompts_per_request": per_request}}})
    run = SimpleNamespace(run_id="r", version=0, ledger=Ledger(), save=lambda: None)
    return SimpleNamespace(
        spec=spec, calls=None, run=run, tok=None, init_model="m", queue=GroupQueue(), timings={},
        sampler=PromptSampler([Example(str(i), str(i)) for i in range(20)], 0), staleness=StalenessBound(max_age),
        trainer_moved=asyncio.Condition(), trainer_step=0, produced_steps=0, reward_version=None,
        engine_activity={}, emit=lambda *a: None, progress=lambda: None)


@pytest.fixture
def requests(monkeypatch):
    """A fake rollout: each request takes a random time; records (step, offset) and the concurrency."""
    seen = SimpleNamespace(calls=[], sizes=[], running=0, peak=0)

    async def fake(calls, spec, run_id, tok, examples, first_index, step, min_version, reference_model, offset=0):
        seen.calls.append((step, offset))
        seen.sizes.append(len(examples))
        seen.running += 1
        seen.peak = max(seen.peak, seen.running)
        await asyncio.sleep(random.Random(step * 10 + offset).uniform(0, 0.02))
        seen.running -= 1
        groups = [Group(prompt_index=first_index + i, prompt_ids=[1], completions=[[2]], gen_logprobs=[[-1.0]],
                        rewards=[1.0], weight_version=min_version, step=step) for i in range(len(examples))]
        return groups, "v1", BatchTimings(generate_s=1.0, activity={"a": (float(step), 0.0, 0.0)})

    monkeypatch.setattr(loop, "rollout_groups", fake)
    return seen


def test_steps_are_committed_whole_in_order_with_bounded_concurrency(requests):
    ctx = context(max_age=STEPS)

    async def main():
        await loop.produce_streaming(ctx)

    asyncio.run(main())
    assert ctx.produced_steps == STEPS and ctx.run.ledger.generated == STEPS * PROMPTS_PER_STEP
    groups = ctx.queue.snapshot()
    assert [g.prompt_index for g in groups] == list(range(STEPS * PROMPTS_PER_STEP))
    assert [g.step for g in groups] == [s for s in range(STEPS) for _ in range(PROMPTS_PER_STEP)]
    assert sorted(requests.calls) == [(s, i) for s in range(STEPS) for i in range(PROMPTS_PER_STEP)]
    assert requests.peak == LIMIT  # bounded, and busy up to the bound (steps overlap)
    assert ctx.timings[0]["timing/generate_s"] == PROMPTS_PER_STEP and ctx.engine_activity == {"a": (2.0, 0.0, 0.0)}


def test_the_bound_holds_back_the_next_step_until_the_trainer_moves(requests):
    ctx = context(max_age=0)

    async def main():
        producer = asyncio.create_task(loop.produce_streaming(ctx))
        while ctx.produced_steps < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert {s for s, _ in requests.calls} == {0}  # step 1 waits for the trainer
        async with ctx.trainer_moved:
            ctx.trainer_step = STEPS
            ctx.trainer_moved.notify_all()
        await producer

    asyncio.run(main())
    assert ctx.produced_steps == STEPS


def test_a_failed_request_ends_the_producer(monkeypatch):
    async def failing(*args, **kwargs):
        raise RuntimeError("rollout down")

    monkeypatch.setattr(loop, "rollout_groups", failing)
    with pytest.raises(RuntimeError, match="rollout down"):
        asyncio.run(loop.produce_streaming(context(max_age=0)))


def test_a_samples_age_is_that_of_its_oldest_version():
    run = rollout_pb2.VersionRun
    completion = rollout_pb2.Completion(samples=[
        rollout_pb2.Sample(token_ids=[1, 2, 3], version_runs=[run(version=4, start=0, end=2), run(version=5, start=2, end=3)]),
        rollout_pb2.Sample(token_ids=[1], version_runs=[run(version=5, start=0, end=1)])])
    assert sample_versions(completion, default=9) == (4, 1, 1)
    assert sample_versions(rollout_pb2.Completion(samples=[rollout_pb2.Sample(token_ids=[1])]), default=9) == (9, 0, 0)


def test_engine_idle_fraction_counts_replicas_seen_at_both_marks():
    ctx = SimpleNamespace(engine_activity={"a": (10.0, 2.0, 1.0)}, activity_mark={})
    assert loop.engine_idle(ctx) == {}  # nothing to compare with yet
    ctx.engine_activity = {"a": (20.0, 3.0, 1.5), "b": (5.0, 5.0, 0.0)}
    assert loop.engine_idle(ctx) == {"engine/idle_fraction": 0.1, "engine/paused_fraction": 0.05}  # b is new
    ctx.engine_activity = {"a": (30.0, 3.0, 1.5), "b": (15.0, 15.0, 2.5)}
    assert loop.engine_idle(ctx) == {"engine/idle_fraction": 0.5, "engine/paused_fraction": 0.125}


def test_requests_carry_several_prompts_at_their_offsets(requests):
    ctx = context(max_age=STEPS, per_request=3)
    asyncio.run(loop.produce_streaming(ctx))
    assert sorted(requests.calls) == [(s, i) for s in range(STEPS) for i in (0, 3)] and sorted(requests.sizes) == \
        [1] * STEPS + [3] * STEPS
    assert [g.prompt_index for g in ctx.queue.snapshot()] == list(range(STEPS * PROMPTS_PER_STEP))
