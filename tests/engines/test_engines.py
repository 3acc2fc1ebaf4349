"""The rollout engines themselves (no services): vLLM's CPU build and transformers agree with
teacher-forced transformers logprobs, and vLLM's in-place weight update switches models exactly."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from rlserve.models import resolve_model
from rlserve.models.factory import make_model
from rlserve.models.presets import get_preset
from rlserve.reference.scorer import ReferenceScorer, Sequence
from rlserve.rollout import make_engine
from rlserve.rollout.interfaces import EngineConfig, SamplingSpec

PROMPTS = [[8, 11, 41, 12, 9, 47], [5, 6, 42, 7], [30, 31, 32]]


@pytest.fixture(scope="module")
def vllm_engine():
    return make_engine("vllm", EngineConfig(model_path=resolve_model("preset:tiny")))


def max_logprob_error(engine_out, model_path) -> float:
    seqs = [Sequence(p + s.token_ids, len(p)) for p, ss in zip(PROMPTS, engine_out) for s in ss]
    ref = ReferenceScorer(model_path).logprobs(seqs)
    gen = [s.logprobs for ss in engine_out for s in ss]
    assert all(len(r) == len(g) > 0 for r, g in zip(ref, gen))
    return max(abs(a - b) for r, g in zip(ref, gen) for a, b in zip(r, g))


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_sampled_logprobs_match_transformers(engine, vllm_engine):
    eng = vllm_engine if engine == "vllm" else make_engine(engine, EngineConfig(model_path=resolve_model("preset:tiny")))
    out = eng.generate(PROMPTS, 4, SamplingSpec(temperature=1.0, max_new_tokens=8, seed=3))
    assert [len(ss) for ss in out] == [4, 4, 4]
    assert all(s.finish_reason in ("stop", "length") for ss in out for s in ss)
    assert max_logprob_error(out, resolve_model("preset:tiny")) < 1e-4


def test_greedy_is_deterministic_and_seeds_repeat(vllm_engine):
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=6)
    assert vllm_engine.generate(PROMPTS, 1, greedy) == vllm_engine.generate(PROMPTS, 1, greedy)
    seeded = SamplingSpec(temperature=1.0, max_new_tokens=6, seed=11)
    assert vllm_engine.generate(PROMPTS, 2, seeded) == vllm_engine.generate(PROMPTS, 2, seeded)


def test_in_place_update_switches_to_the_new_model(vllm_engine, tmp_path):
    base, other = resolve_model("preset:tiny"), make_model(get_preset("tiny"), tmp_path / "other", seed=99)
    try:
        vllm_engine.load_weights(load_file(other / "model.safetensors").items())
        out = vllm_engine.generate(PROMPTS, 2, SamplingSpec(temperature=1.0, max_new_tokens=8, seed=5))
        assert max_logprob_error(out, other) < 1e-4
        assert max_logprob_error(out, base) > 1e-2  # the test would notice stale weights
    finally:
        vllm_engine.load_weights_from_path(base)
    out = vllm_engine.generate(PROMPTS, 2, SamplingSpec(temperature=1.0, max_new_tokens=8, seed=5))
    assert max_logprob_error(out, base) < 1e-4
