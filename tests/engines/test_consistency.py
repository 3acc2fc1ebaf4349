"""The consistency contract on the real engines and the real learner: short real runs of the library's loop
(`tests/support/engine_learner.py`: a real engine generates, the real dtensor learner trains and measures,
its exports reach the engine in place) assert the run's median token_mult_prob_error and |delta logprob|
under the gate's bounds, for the engine/model/training/turns combinations the integration runs do not
cover (those assert the same bounds on their own STEP metrics: test_runs.py, test_lora_runs.py,
test_multiturn_runs.py, test_default_cluster.py). One transfer corrupted on purpose trips the guard.

The bounds (`GATE`), and why: both engines run fp32 on the CPU here, as does the learner, so a sampled
token's logprob differs between them only by kernel rounding. Measured over these runs (BENCHMARKS.md,
"Rollout-training consistency on CPU"): median token_mult_prob_error 1.0000002, median mean |delta
logprob| 1.7-2.0e-7, worst token 9.5e-7 (transformers and vLLM alike, dense and MoE, LoRA or not). The
gate sits about 100x above them, so kernel noise never crosses it while any real defect does (one
corrupted transfer measures token_mult_prob_error 1.2 and mean |delta logprob| 0.2), and far inside the
peers' CI bounds (NeMo-RL: median token_mult_prob_error below 1.1; miles: |delta logprob| <= 0.03),
which are set for bf16 GPUs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from rlserve.config import RunSpec, spec_to_yaml
from rlserve.environments.interfaces import Environment, StepInput, StepOutput
from rlserve.loop.algorithm import algorithm_class
from rlserve.loop.inputs import LoopSettings, RunInputs
from rlserve.loop.recovery import run_to_end
from rlserve.models import resolve_model
from rlserve.rollout import make_engine
from rlserve.rollout.interfaces import EngineConfig
from rlserve.runs.record import Run, RunPaused
from rlserve.v1 import coordinator_pb2 as pb
from tests.support.aio import LoopThread
from tests.support.engine_learner import EngineLearnerServices

# The gate (module docstring): the run's median token_mult_prob_error and mean |delta logprob|, and the worst
# token's |delta logprob| over the run.
GATE = {"token_mult_prob_error": 1.00002, "logprob_abs_diff_mean": 2e-5, "logprob_abs_diff_max": 1e-4}
SETTINGS = LoopSettings(weight_store="in-process", watchdog_timeout_s=300)
MOE = "preset:qwen3-moe-tiny"


class Answer(Environment):
    """Never done: every turn hears "12" (digits: the char tokenizer's), so episodes run to the turn limit."""

    name = "answer"

    def step(self, step: StepInput) -> StepOutput:
        return StepOutput([{"role": "user", "content": "12"}], 0.1 * step.turn, False)


def spec(model: str, lora: bool = False, turns: int = 1, replay: bool = False, **loss_fn) -> RunSpec:
    data = {
        "name": "gate",
        "policy": {"model_name": model, "max_total_sequence_length": 64, "train_micro_batch_size": 8,
                   # A third of the (62-token) vocabulary ends a turn: turns end by themselves, episodes reach 3.
                   "generation": {"max_new_tokens": 6, "temperature": 1.0, "stop_token_ids": list(range(5, 62, 3))},
                   "routing_replay": replay,
                   "dtensor_cfg": {"lora_cfg": {"enabled": lora, "dim": 8}},
                   "optimizer": {"kwargs": {"lr": 1e-3}}},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": 3, "val_period": 0,
                 "val_at_start": False, "max_rollout_turns": turns},
        "loss_fn": {"use_importance_sampling_correction": True, **loss_fn},
        "data": {"task": "addition", "num_train": 32, "num_val": 4},
        "checkpointing": {"save_period": 2},
        "logger": {"tensorboard_enabled": False, "plot_enabled": False},
        "cluster": {"device": "cpu"},
    }
    if turns > 1:
        data["env"] = {"enabled": True, "name": "answer", "import_path": "tests.engines.test_consistency:Answer"}
    return RunSpec.model_validate(data)


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


def engine_for(loop: LoopThread, engine: str, model: str, lora: bool):
    async def start():
        return make_engine(engine, EngineConfig(model_path=resolve_model(model), max_model_len=128,
                                                enable_lora=lora, max_lora_rank=8, device="cpu"))
    return loop.run(start())


def short_run(loop: LoopThread, tmp_path: Path, engine, run_spec: RunSpec, corrupt_version: int | None = None
              ) -> tuple[Run, list[dict], EngineLearnerServices]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.yaml").write_text(spec_to_yaml(run_spec))
    run = Run("gate", run_spec, run_dir)
    inputs = RunInputs.build("gate", run_spec, run_dir, algorithm_class(run_spec).data)
    services = EngineLearnerServices(engine, inputs.model_path, corrupt_version=corrupt_version,
                                     environments={"answer": Answer()})
    try:
        loop.run(run_to_end(run, services, SETTINGS), timeout=900)
    finally:
        rows = [r for r in run.recorder.read("metrics.jsonl") if r["step"] > 0]
    return run, rows, services


def assert_within_gate(rows: list[dict]) -> dict[str, float]:
    trained = [r for r in rows if "mismatch/token_mult_prob_error" in r]
    assert trained, "no step trained"
    got = {"token_mult_prob_error": statistics.median(r["mismatch/token_mult_prob_error"] for r in trained),
           "logprob_abs_diff_mean": statistics.median(r["mismatch/logprob_abs_diff_mean"] for r in trained),
           "logprob_abs_diff_max": max(r["mismatch/logprob_abs_diff_max"] for r in trained)}
    print("consistency:", {k: f"{v:.3g}" for k, v in got.items()})
    assert all(got[k] < GATE[k] for k in GATE), (got, GATE)
    return got


# (engine, model, LoRA, turns): with the integration runs, every engine meets both models, both kinds of
# training and both kinds of episode, but for vLLM with LoRA on a MoE model, which vLLM's CPU build cannot
# serve (its fused-MoE LoRA kernels are Triton's: "triton.language has no attribute float32"). MoE runs
# replay their routing on the transformers engine, which records it; vLLM's CPU backend cannot.
COMBOS = [
    ("transformers", "preset:tiny", True, 3),
    ("transformers", MOE, False, 1),
    ("transformers", MOE, True, 3),
    ("vllm", MOE, False, 3),
]


@pytest.mark.parametrize("engine_name,model,lora,turns", COMBOS,
                         ids=[f"{e}-{'moe' if m == MOE else 'dense'}-{'lora' if lo else 'full'}-{t}turn"
                              for e, m, lo, t in COMBOS])
def test_a_short_run_stays_within_the_gate(engine_name, model, lora, turns, loop, tmp_path):
    replay = model == MOE and engine_name == "transformers"
    engine = engine_for(loop, engine_name, model, lora)
    try:
        run, rows, services = short_run(loop, tmp_path, engine, spec(model, lora, turns, replay))
    finally:
        loop.run(engine.close())
    assert run.step == 3
    assert_within_gate(rows)
    if turns > 1:
        assert any(k.startswith("mismatch/turn_3/") for r in rows for k in r)  # split by turn
    assert all((b.routed_experts is not None) == replay for b in services.calls.batches)


def test_a_corrupted_transfer_trips_the_guard_which_pauses_the_run_resumably(loop, tmp_path):
    """Version 1 reaches the engine with noise on every tensor: step 2 samples from weights the learner never
    had, its metrics leave the gate by orders of magnitude, and the guard (pause) names step 2, the metric,
    its value and the weights as the likely cause, after a checkpoint there."""
    engine = engine_for(loop, "transformers", "preset:tiny", False)
    try:
        with pytest.raises(RunPaused) as paused:
            short_run(loop, tmp_path, engine, spec("preset:tiny", mismatch_guard={"action": "pause"}),
                      corrupt_version=1)
    finally:
        loop.run(engine.close())
    message = str(paused.value)
    assert "step 2: mismatch/token_mult_prob_error = " in message and "is above loss_fn.mismatch_guard.max 1.1" in \
        message and "likely causes: the engines serve other weights than the learner's" in message, message
    run_dir = tmp_path / "run"
    assert (run_dir / "checkpoints" / "step_000002" / "coordinator.json").is_file()
    rows = {r["step"]: r for r in Run.from_disk(run_dir).recorder.read("metrics.jsonl")}
    assert rows[1]["mismatch/token_mult_prob_error"] < GATE["token_mult_prob_error"]
    assert rows[2]["mismatch/token_mult_prob_error"] > 1.1 and rows[2]["mismatch/guard_exceeded"] == 1.0
    events = [ev for ev in Run.from_disk(run_dir).events if ev.kind == pb.EVENT_KIND_WARNING]
    assert any(ev.message.startswith("step 2: mismatch/token_mult_prob_error") for ev in events)
