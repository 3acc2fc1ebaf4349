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


def test_seeded_sampling_of_a_batch_beyond_one_scheduler_step(vllm_engine):
    """64 prompts x 8 samples x 40 tokens (20k prompt tokens, several scheduler steps) with seeds,
    as a GRPO step with chat-template prompts sends them; vLLM's CPU backend used to fail here.
    (Before any test that starts a second engine: its teardown leaves this one unusable.)"""
    prompts = [[5 + (i + j) % 40 for j in range(40)] for i in range(64)]
    out = vllm_engine.generate(prompts, 8, SamplingSpec(temperature=1.0, max_new_tokens=4, seed=7))
    assert [len(ss) for ss in out] == [8] * 64 and all(len(s.token_ids) > 0 for ss in out for s in ss)


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


def test_vllm_loads_the_bpe_tokenizer_and_its_chat_template():
    from vllm.tokenizers import get_tokenizer

    from rlserve.data.prompts import PromptTokenizer
    from rlserve.data.tasks import Example

    path = resolve_model("preset:tiny-chat")
    ours = PromptTokenizer(path, "chat", "Be brief.")
    tok = get_tokenizer(path)
    ex = Example("What is 47+85?", "132")
    messages = ours.messages(ex)
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) \
        == ours.prompt_ids(ex)
    assert tok.encode("What is 47+85?", add_special_tokens=False) == ours.encode("What is 47+85?")
    assert tok.eos_token_id == ours.eos_ids[0]
