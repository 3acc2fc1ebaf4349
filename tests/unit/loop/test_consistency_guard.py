"""The consistency guard in whole runs against the in-memory services: a step whose generator-vs-learner
metric crosses `loss_fn.mismatch_guard.max` gets a WARNING naming the step, the metric, its value and the
likely causes; `warn` goes on, `pause` checkpoints that step and stops resumably, `fail` fails; every step
carries the run's medians, which the summary event states."""

from __future__ import annotations

import asyncio

import pytest

from rlserve.loop.inputs import LoopSettings
from rlserve.loop.recovery import run_to_end
from rlserve.runs.record import RunPaused
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2
from tests.support.fake_services import FakeServices

SETTINGS = LoopSettings(weight_store="fake", watchdog_timeout_s=60)


class DriftsAt(FakeServices):
    """The learner reports the generator within 1e-4 of it, except at the steps in `off` (weights that did
    not reach the engine: token_mult_prob_error 1.9)."""

    def __init__(self, off: set[int], **kw):
        super().__init__(**kw)
        self.off = off

    async def train_step(self, req, batch) -> learner_pb2.TrainStepResponse:
        resp = await super().train_step(req, batch)
        step = resp.weight_version  # one version per step here
        bad = step in self.off
        resp.metrics.update({"mismatch/token_mult_prob_error": 1.9 if bad else 1.0001,
                             "mismatch/logprob_abs_diff_mean": 0.64 if bad else 1e-4,
                             "mismatch/logprob_abs_diff_max": 3.0 if bad else 4e-4,
                             "mismatch/is_truncated_fraction": 0.2 if bad else 0.0,
                             "mismatch/gen_kl_k3": 0.3 if bad else 1e-8,
                             "mismatch/age_0/logprob_abs_diff_mean": 0.64 if bad else 1e-4})
        return resp


def guard_run(make_run, action: str, steps: int = 4, run_id: str = "r"):
    run, _ = make_run(run_id, grpo={"max_num_steps": steps, "val_period": 0},
                      loss_fn={"mismatch_guard": {"action": action}}, checkpointing={"save_period": 10})
    return run


def warnings(run) -> list[str]:
    return [ev.message for ev in run.events if ev.kind == pb.EVENT_KIND_WARNING]


def test_warn_names_the_step_metric_value_and_causes_and_the_run_goes_on(make_run):
    run = guard_run(make_run, "warn")
    asyncio.run(run_to_end(run, DriftsAt({2}), SETTINGS))
    assert run.step == 4
    (warning,) = [w for w in warnings(run) if "mismatch_guard" in w]
    assert warning.startswith("step 2: mismatch/token_mult_prob_error = 1.9 is above loss_fn.mismatch_guard.max 1.1")
    assert "likely causes: the engines serve other weights than the learner's" in warning
    assert warning.endswith("the run goes on")
    rows = run.recorder.read("metrics.jsonl")[1:]
    assert [r["mismatch/guard_exceeded"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert [r["mismatch/run_median/token_mult_prob_error"] for r in rows] == pytest.approx(
        [1.0001, (1.0001 + 1.9) / 2, 1.0001, 1.0001])
    summary = [ev.message for ev in run.events if ev.message.startswith("final policy in")][0]
    assert "consistency: median token_mult_prob_error 1.0001, median |delta logprob| 0.0001" in summary


def test_pause_checkpoints_the_step_and_the_run_resumes_from_it(make_run):
    run = guard_run(make_run, "pause")
    with pytest.raises(RunPaused, match="step 2: mismatch/token_mult_prob_error = 1.9 .* the run pauses"):
        asyncio.run(run_to_end(run, DriftsAt({2}), SETTINGS))
    assert run.step == 2 and (run.run_dir / "checkpoints" / "step_000002" / "coordinator.json").is_file()
    # Resumed (the engines mended): it continues from the paused step, the ledger balancing.
    run.resume("resumed by SubmitRun")
    services = DriftsAt(set())
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert run.step == 4 and run.ledger.balanced() and services.calls.configure == 1
    assert [r["step"] for r in run.recorder.read("metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_fail_fails_the_run_and_a_healthy_run_is_never_stopped(make_run):
    run = guard_run(make_run, "fail")
    with pytest.raises(RuntimeError, match="loss_fn.mismatch_guard: step 3: .* the run fails"):
        asyncio.run(run_to_end(run, DriftsAt({3}), SETTINGS))
    healthy = guard_run(make_run, "fail", run_id="healthy")
    asyncio.run(run_to_end(healthy, DriftsAt(set()), SETTINGS))
    assert healthy.step == 4 and not [w for w in warnings(healthy) if "mismatch_guard" in w]


def test_cispo_with_ppo_bounds_warns_at_the_start(make_run):
    run, _ = make_run(grpo={"max_num_steps": 1, "val_period": 0}, loss_fn={"name": "cispo"})
    asyncio.run(run_to_end(run, FakeServices(), SETTINGS))
    assert any(w.startswith("loss_fn.name: cispo with PPO's clip range") for w in warnings(run))
    tuned, _ = make_run("tuned", grpo={"max_num_steps": 1, "val_period": 0},
                        loss_fn={"name": "cispo", "ratio_clip_min": 1.0, "ratio_clip_max": 5.0})
    asyncio.run(run_to_end(tuned, FakeServices(), SETTINGS))
    assert not any("cispo" in w for w in warnings(tuned))
