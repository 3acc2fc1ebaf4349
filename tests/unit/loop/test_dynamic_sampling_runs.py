"""DAPO's dynamic sampling in whole runs against the in-memory services: when half the groups are
all-correct the producer refills every step to its batch, the ledger counts what it filtered (and
any surplus) with their own reasons and balances, the bound on generation batches is reported, and
a run resumed from a checkpoint takes the prompts an uninterrupted one would."""

from __future__ import annotations

import asyncio

from rlserve.loop.inputs import LoopSettings
from rlserve.loop.recovery import run_to_end
from rlserve.runs.ledger import Ledger
from rlserve.runs.record import Run
from rlserve.trajectories.producer import FILTERED, SURPLUS
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import reward_pb2
from tests.support.fake_services import FakeServices

SETTINGS = LoopSettings(weight_store="fake", watchdog_timeout_s=60)
STEPS, PROMPTS, GENERATIONS = 4, 4, 4


class HalfSolved(FakeServices):
    """Prompts at even data positions are solved by every sample (reward 1, no signal); the others
    by every other sample. (Training items are named run/step/prompt/sample; validation scores 0.)"""

    async def score(self, req: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        results = []
        for item in req.items:
            parts = item.id.split("/")
            prompt, sample = (int(parts[2]), int(parts[3])) if len(parts) == 4 else (1, 0)
            score = 1.0 if prompt % 2 == 0 else float(sample % 2)
            results.append(reward_pb2.ScoreResult(id=item.id, score=score, status=reward_pb2.SCORE_STATUS_OK))
        return reward_pb2.ScoreResponse(results=results, reward_version="half-solved")


def dynamic(make_run, **grpo) -> Run:
    run, _ = make_run(grpo={"use_dynamic_sampling": True, "max_num_steps": STEPS, **grpo})
    return run


def trained_per_step(services: FakeServices) -> list[int]:
    return [n for _, n in services.calls.train]


def balanced_as_announced(run: Run) -> bool:
    announced = Ledger(run.ledger.generated, run.ledger.scored).as_announced(run.events)
    return run.ledger.balanced() and announced.to_dict() == run.ledger.to_dict()


def test_half_all_correct_groups_still_train_full_batches_and_the_ledger_balances(make_run):
    run = dynamic(make_run)
    services = HalfSolved()
    asyncio.run(run_to_end(run, services, SETTINGS))
    batch = PROMPTS * GENERATIONS
    assert run.step == STEPS and trained_per_step(services) == [batch] * STEPS
    # Each step needed two generation batches of 4 prompts: half of each filtered.
    assert run.ledger.generated == STEPS * 2 * batch and run.ledger.trained == STEPS * batch
    assert dict(run.ledger.dropped) == {FILTERED: STEPS * batch}
    assert balanced_as_announced(run)
    rows = run.recorder.read("metrics.jsonl")[1:]
    assert [r["dynamic_sampling/filtered_fraction"] for r in rows] == [0.5] * STEPS
    assert [r["dynamic_sampling/num_gen_batches"] for r in rows] == [2.0] * STEPS
    assert [r["data/cursor"] for r in rows] == [0, 8, 16, 24]
    assert all(r["batch/groups_trained"] == PROMPTS for r in rows)


def test_a_larger_generation_batch_drops_the_surplus_with_its_own_reason(make_run):
    run = dynamic(make_run, batch_multiplier=1.5)  # 6 prompts a batch: 3 with signal each
    services = HalfSolved()
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert trained_per_step(services) == [PROMPTS * GENERATIONS] * STEPS
    assert dict(run.ledger.dropped) == {FILTERED: STEPS * 6 * GENERATIONS, SURPLUS: STEPS * 2 * GENERATIONS}
    assert balanced_as_announced(run)
    assert run.recorder.read("metrics.jsonl")[-1]["dynamic_sampling/discarded_valid_groups"] == 2


def test_reaching_max_gen_batches_is_reported_and_the_step_trains_what_it_has(make_run):
    run = dynamic(make_run, dynamic_sampling_max_gen_batches=1)
    services = HalfSolved()
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert trained_per_step(services) == [PROMPTS // 2 * GENERATIONS] * STEPS
    warnings = [ev.message for ev in run.events if ev.kind == pb.EVENT_KIND_WARNING]
    assert len(warnings) == STEPS and "grpo.dynamic_sampling_max_gen_batches" in warnings[0]
    assert "2 of 4 groups" in warnings[0]
    assert run.recorder.read("metrics.jsonl")[-1]["dynamic_sampling/groups_short"] == 2
    assert balanced_as_announced(run)


def test_streaming_and_async_refill_full_batches_within_the_staleness_bound(make_run):
    run = dynamic(make_run, async_grpo={"enabled": True, "max_trajectory_age_steps": 1, "streaming": True,
                                        "prompts_per_request": 1, "max_prompts_in_flight": 2},
                  val_period=0, val_at_start=False)  # validation's requests are not the producer's
    services = HalfSolved(generate_delay_s=0.01)
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert trained_per_step(services) == [PROMPTS * GENERATIONS] * STEPS
    assert run.ledger.dropped.get("stale", 0) == 0 and balanced_as_announced(run)
    assert services.calls.peak <= 2
    rows = run.recorder.read("metrics.jsonl")  # no validation at the start: no step-0 row
    assert max(r["batch/staleness_max"] for r in rows) <= 1
    assert [r["data/cursor"] for r in rows] == [0, 8, 16, 24]


def test_a_recovered_run_resumes_at_the_checkpointed_data_cursor(make_run):
    run = dynamic(make_run)
    services = HalfSolved(lose_state_at_version=3)  # dies in step 4, after the step-2 checkpoint
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert run.step == STEPS and balanced_as_announced(run)
    assert [r["data/cursor"] for r in run.recorder.read("metrics.jsonl")[1:]] == [0, 8, 16, 24]
    assert run.ledger.dropped["recovered"] > 0


def test_without_dynamic_sampling_the_trainer_drops_them_and_trains_half_batches(make_run):
    run, _ = make_run(grpo={"max_num_steps": STEPS})
    services = HalfSolved()
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert trained_per_step(services) == [PROMPTS // 2 * GENERATIONS] * STEPS
    assert dict(run.ledger.dropped) == {"zero_advantage": STEPS * PROMPTS // 2 * GENERATIONS}


def test_reinforce_plus_plus_trains_tied_groups_unless_dynamic_sampling_is_asked_for(make_run):
    """REINFORCE++ normalises over the batch, so a tied group's advantages are not zero: the trainer keeps
    it (dropping it would move the other groups' advantages); dynamic sampling still filters it."""
    estimator = {"adv_estimator": {"name": "reinforce_plus_plus"}}
    run, _ = make_run(grpo={"max_num_steps": STEPS, **estimator})
    services = HalfSolved()
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert trained_per_step(services) == [PROMPTS * GENERATIONS] * STEPS and not run.ledger.dropped
    run, _ = make_run("dynamic", grpo={"use_dynamic_sampling": True, "max_num_steps": STEPS, **estimator})
    asyncio.run(run_to_end(run, HalfSolved(), SETTINGS))
    assert dict(run.ledger.dropped) == {FILTERED: STEPS * PROMPTS * GENERATIONS}
