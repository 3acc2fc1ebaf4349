"""Multi-turn episodes on the real engine (vLLM's CPU build, fp32) and the real learner: the learner's
logprobs of a 3-turn trajectory equal the logprobs the engine sampled with, on every token of the
policy, within 1e-4 (padded and packed), and a step trains on it with only those tokens counted.

The episodes run through the library's producer (`trajectories/rollout.py`, `episodes.py`) against vLLM's AsyncLLM and an
environment that always answers, on the `tiny-chat` preset (byte-level BPE, ChatML template), so the
trajectory holds the template's turn markers and observation tokens between the engine's turns."""

from __future__ import annotations

import time

import pytest
import torch

from rlserve.config import RunSpec, spec_to_yaml
from rlserve.environments.interfaces import Environment, StepInput, StepOutput
from rlserve.loop.algorithm import algorithm_class
from rlserve.loop.inputs import RunInputs
from rlserve.models import resolve_model
from rlserve.rollout import make_engine
from rlserve.rollout.interfaces import EngineConfig
from rlserve.trajectories.batch import build_batch
from rlserve.trajectories.rollout import play
from rlserve.v1 import common_pb2, rollout_pb2
from tests.support.aio import LoopThread
from tests.support.dist import run_ranks
from tests.support.fake_services import FakeServices
from tests.support.trajectories import first_step

MODEL = "preset:tiny-chat"
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT}


class Answer(Environment):
    """Never done: every turn hears the same short reply (the turn limit ends the episode)."""

    name = "answer"

    def step(self, step: StepInput) -> StepOutput:
        return StepOutput([{"role": "user", "content": f"try again {step.turn}"}], 0.1 * step.turn, False)


class EngineServices(FakeServices):
    """The fake services with generation by a real engine in this process."""

    def __init__(self, engine, **kw):
        super().__init__(**kw)
        self.engine = engine

    async def generate(self, req: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        from services.rollout.app import sampling_from_proto

        self.calls.generate.append(req)
        prompts = [list(p.token_ids.ids) for p in req.prompts]
        t0 = time.perf_counter()
        outputs = await self.engine.generate(prompts, req.num_samples or 1, sampling_from_proto(req.sampling))
        completions = [rollout_pb2.Completion(prompt_token_ids=ids, samples=[
            rollout_pb2.Sample(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=_FINISH[s.finish_reason],
                               text=s.text, version_runs=[rollout_pb2.VersionRun(version=r.version, start=r.start,
                                                                                  end=r.end) for r in s.version_runs])
            for s in samples]) for ids, samples in zip(prompts, outputs)]
        return rollout_pb2.GenerateResponse(completions=completions, weight_version=0, replica_id="engine",
                                            engine_seconds=time.perf_counter() - t0)


def spec_dict() -> dict:
    vocab = 640
    return {
        "policy": {"model_name": MODEL, "max_total_sequence_length": 192, "train_micro_batch_size": 2,
                   # A third of the vocabulary ends a turn, so turns are a few tokens and end by themselves
                   # (a random model rarely says its end-of-turn token).
                   "generation": {"max_new_tokens": 24, "stop_token_ids": list(range(5, vocab, 3))},
                   "sequence_packing": {"train_mb_tokens": 4096}},
        "data": {"task": "addition", "prompt_format": "chat", "num_train": 50, "num_val": 4},
        "env": {"enabled": True, "name": "answer", "import_path": "tests.engines.test_multiturn_engine:Answer"},
        "grpo": {"max_rollout_turns": 3, "num_generations_per_prompt": 4, "num_prompts_per_step": 2},
        "loss_fn": {"use_importance_sampling_correction": True},
    }


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    spec = RunSpec.model_validate(spec_dict())
    run_dir = tmp_path_factory.mktemp("mt")
    (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
    inputs = RunInputs.build("mt", spec, run_dir, algorithm_class(spec).data)
    loop = LoopThread()
    try:
        engine = loop.run(_start())
        try:
            services = EngineServices(engine, environments={"answer": Answer()})
            groups = loop.run(play(services, inputs, first_step(inputs, list(inputs.train[:2])),
                                   inputs.model_path)).groups
        finally:
            loop.run(engine.close())
    finally:
        loop.close()
    return inputs, groups


async def _start():
    return make_engine("vllm", EngineConfig(model_path=resolve_model(MODEL), max_model_len=256))


def learner_logprobs(rank: int, world: int, spec: dict, batch, packed: bool):
    """Per micro-batch: the learner's logprobs of its completion tokens, the generator's, and the loss mask;
    then one training step's metrics on the batch."""
    from rlserve.config import parse_spec
    from rlserve.learner.dtensor.backend import DTensorBackend
    from rlserve.training.objective import StepObjective

    spec = {**spec, "policy": {**spec["policy"], "sequence_packing": {**spec["policy"]["sequence_packing"],
                                                                      "enabled": packed}}}
    parsed = parse_spec(spec)
    backend = DTensorBackend(parsed, resolve_model(MODEL), torch.device("cpu"))
    objective = StepObjective(parsed, batch, "grpo", dp_size=1, dp_rank=0, pad_id=backend.pad_id)
    out = []
    with torch.no_grad():
        for plan in objective.plans:
            for mb in plan:
                lps, _ = backend.model(mb, with_entropy=False)
                out.append((lps, mb.gen_logprobs, mb.loss_mask))
    metrics = backend.train_step(batch, "grpo").metrics
    return out, metrics


def test_episodes_hold_three_turns_with_observations_between(episodes):
    inputs, groups = episodes
    assert all(not g.env_failures for g in groups)
    three = [(g, t) for g in groups for t in g.trajectories if t.turns == 3]
    assert three, [[t.turns for t in g.trajectories] for g in groups]
    g, traj = three[0]
    assert traj.ending == "max_turns"
    mask = traj.mask
    runs = [m for k, m in enumerate(mask) if k == 0 or m != mask[k - 1]]
    assert runs == [True, False, True, False, True]  # policy, observation, policy, observation, policy
    text = inputs.tok.tok.decode(g.prompt_ids + traj.tokens)
    assert text.count("<|im_start|>user\ntry again") == 2 and text.count("<|im_start|>assistant\n") == 3


@pytest.mark.parametrize("packed", [False, True])
def test_learner_logprobs_equal_the_engines_on_every_policy_token(episodes, packed):
    inputs, groups = episodes
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]] * len(groups))
    batch = build_batch(groups, adv, with_reference=False)
    (result,) = run_ranks(1, learner_logprobs, spec_dict(), batch, packed)
    per_mb, metrics = result
    worst, counted = 0.0, 0
    for lps, gen, mask in per_mb:
        keep = mask > 0
        worst = max(worst, float((lps[keep] - gen[keep]).abs().max()))
        counted += int(keep.sum())
    assert counted == int(batch.loss_mask.sum()) > 0
    assert worst < 1e-4, worst
    # The step counts the policy's tokens only.
    assert metrics["batch/valid_tokens"] == float(batch.loss_mask.sum())
    assert metrics["batch/valid_tokens"] < float(batch.completion_lens.sum())
