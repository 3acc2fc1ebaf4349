"""The transformers engine's fast generation paths (`EngineSettings.generation`: continuous batching, a static
cache) on the CPU with the tiny model: `n` samples of prompts of different lengths, each sampled token's logprob
equal to a teacher-forced pass's (the model's own temperature-1 distribution over the whole vocabulary, also
when temperature, top-k and top-p cut the sampling), stop tokens and max_new_tokens as `generate` has them; a
weight update copied in place reaches the kept continuous-batching manager (no rebuild), and the same seed then
samples the other model's tokens, and the first model's again once its weights return. LoRA adapters and
what continuous batching cannot sample fall back to `generate`, saying why. (The CUDA graphs and compiled decode
these paths use on a GPU are measured by scripts/bench/generation_gpu.py.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlserve.models import resolve_model
from rlserve.models.factory import make_model
from rlserve.models.presets import get_preset
from rlserve.rollout.hf_engine import TransformersEngine
from rlserve.rollout.hf_generation import resolve
from rlserve.rollout.interfaces import EngineConfig, SamplingSpec
from tests.engines.test_lora_engines import peft_logprobs, random_adapter
from tests.support.batches import completion_logprobs

PROMPTS = [[8, 11, 41, 12, 9, 47, 3, 22, 19], [5, 6, 42, 7], [30, 31, 32]]
# A fifth of the 62-token vocabulary stops a sample: some stop early, some run to max_new_tokens.
STOPS = tuple(range(7, 62, 5))
PLAIN = SamplingSpec(temperature=1.0, max_new_tokens=10, stop_token_ids=STOPS, seed=3)
CUT = SamplingSpec(temperature=0.7, top_p=0.8, top_k=5, max_new_tokens=10, seed=4)


def engine(generation: str, **settings) -> TransformersEngine:
    return TransformersEngine(EngineConfig(model_path=resolve_model("preset:tiny"), device="cpu", max_num_seqs=16,
                                           max_model_len=64, generation=generation, **settings))


def teacher_forced(model_path, out) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    seqs = [p + s.token_ids for p, ss in zip(PROMPTS, out) for s in ss]
    return completion_logprobs(model, seqs, [len(p) for p, ss in zip(PROMPTS, out) for _ in ss])


def sampled(out) -> torch.Tensor:
    return torch.tensor([x for ss in out for s in ss for x in s.logprobs])


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return make_model(get_preset("tiny"), tmp_path_factory.mktemp("other") / "other", seed=99)


def test_auto_is_compiled_on_cuda_else_generate():
    assert resolve("auto", torch.device("cuda")) == "compiled"
    assert resolve("auto", torch.device("cpu")) == "generate"
    assert resolve("static", torch.device("cpu")) == "static"


@pytest.mark.parametrize("generation", ["continuous", "static", "compiled"])
@pytest.mark.parametrize("sampling", [PLAIN, CUT], ids=["plain", "top-p-top-k"])
def test_samples_are_exact_and_stop_as_generate_does(generation, sampling):
    eng = engine(generation)
    out = eng.generate(PROMPTS, 4, sampling)
    assert [len(ss) for ss in out] == [4, 4, 4]
    stops = {*eng.eos_ids, *sampling.stop_token_ids}
    for s in (s for ss in out for s in ss):
        assert len(s.token_ids) == len(s.logprobs) > 0
        assert not stops & set(s.token_ids[:-1])
        if s.finish_reason == "stop":
            assert s.token_ids[-1] in stops
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == sampling.max_new_tokens
    if sampling is PLAIN:
        assert {s.finish_reason for ss in out for s in ss} == {"stop", "length"}
    torch.testing.assert_close(sampled(out), teacher_forced(resolve_model("preset:tiny"), out), atol=1e-4, rtol=0)
    # The n samples of a prompt are drawn independently (forked after the prefill), not copies.
    assert all(len({tuple(s.token_ids) for s in ss}) > 1 for ss in out)


def test_every_engine_of_a_process_runs_its_compiled_path_on_one_thread():
    """torch 2.11's CUDA graph trees fail a compiled call from a thread other than the one that first compiled
    (`hf_generation.on_generation_thread`): two engines' static and compiled paths share one thread, which is not
    the caller's."""
    threads = []

    def recorded(fn):
        def call(*args):
            threads.append(threading.get_ident())
            return fn(*args)
        return call

    compiled, static = engine("compiled"), engine("static")
    compiled._decode.generate = recorded(compiled._decode.generate)
    static._generate = recorded(static._generate)
    for eng in (compiled, static, compiled):
        eng.generate(PROMPTS, 2, PLAIN)
    assert len(threads) == 3 and len(set(threads)) == 1 and threads[0] != threading.get_ident()


def test_an_in_place_weight_update_reaches_the_kept_continuous_batching_manager(other_model):
    eng = engine("continuous")
    first = eng.generate(PROMPTS, 4, PLAIN)
    model, manager = eng.model, eng._continuous._manager
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    eng.load_weights(list(load_file(other_model / "model.safetensors").items()))  # the same-device handoff's call
    other = eng.generate(PROMPTS, 4, PLAIN)
    assert eng.model is model and eng._continuous._manager is manager  # updated in place, nothing rebuilt
    assert [s.token_ids for ss in other for s in ss] != [s.token_ids for ss in first for s in ss]
    torch.testing.assert_close(sampled(other), teacher_forced(other_model, other), atol=1e-4, rtol=0)
    eng.load_weights(list(original.items()))
    again = eng.generate(PROMPTS, 4, PLAIN)
    assert [s.token_ids for ss in again for s in ss] == [s.token_ids for ss in first for s in ss]
    torch.testing.assert_close(sampled(again), sampled(first), atol=1e-5, rtol=0)


def test_what_continuous_batching_cannot_sample_falls_back_to_generate_and_says_so(caplog):
    eng = engine("continuous")
    with caplog.at_level(logging.INFO, logger="rlserve.rollout"):
        out = eng.generate(PROMPTS, 2, SamplingSpec(max_new_tokens=6, min_new_tokens=6, seed=1))
    assert all(len(s.token_ids) == 6 for ss in out for s in ss)
    assert eng._continuous._manager is None
    assert "generation continuous: min_new_tokens is set, so generate serves such requests" in caplog.text
    torch.testing.assert_close(sampled(out), teacher_forced(resolve_model("preset:tiny"), out), atol=1e-4, rtol=0)


def test_prompt_logprobs_come_with_continuous_batchings_samples():
    """Prompt logprobs (Tinker's sampling asks for them) are a forward pass of the model after the batch: the
    manager has handed the model back with its own attention."""
    eng = engine("continuous")
    out = eng.generate(PROMPTS, 2, SamplingSpec(max_new_tokens=4, prompt_logprobs=0, top_logprobs=0, seed=1))
    assert eng._continuous._manager is not None
    model = AutoModelForCausalLM.from_pretrained(resolve_model("preset:tiny"), dtype=torch.float32).eval()
    for prompt, samples in zip(PROMPTS, out):
        want = completion_logprobs(model, [prompt], [1])
        for s in samples:
            torch.testing.assert_close(torch.tensor(s.prompt_logprobs), want, atol=1e-4, rtol=0)


def test_lora_adapters_fall_back_to_generate_exactly(tmp_path, caplog):
    eng = engine("continuous", enable_lora=True, max_lora_rank=16)
    folder = random_adapter(tmp_path / "adapter", 1)
    eng.load_adapter(shutil.copytree(folder, tmp_path / "v1"), resolve_model("preset:tiny"))
    with caplog.at_level(logging.INFO, logger="rlserve.rollout"):
        out = eng.generate(PROMPTS, 2, PLAIN)
    assert "generation continuous: LoRA adapters are served, so generate serves such requests" in caplog.text
    torch.testing.assert_close(sampled(out), peft_logprobs(folder, PROMPTS, out), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (GPU-only test)")
@pytest.mark.parametrize("generation", ["continuous", "static", "compiled"])
def test_on_cuda_captured_graphs_and_the_compiled_step_see_an_in_place_update(generation, other_model):
    """GPU-only: continuous batching with its CUDA graphs captured (forced on: without flash attention
    transformers would leave them off), and the static cache's compiled decode step, sample exactly before and
    after a weight update copied into the parameters (nothing rebuilt, nothing recompiled for it)."""
    eng = TransformersEngine(EngineConfig(model_path=resolve_model("preset:tiny"), device="cuda", max_num_seqs=16,
                                          max_model_len=64, generation=generation))
    if eng._continuous is not None:
        eng._continuous.cuda_graphs = True
    first = eng.generate(PROMPTS, 4, PLAIN)
    torch.testing.assert_close(sampled(first), teacher_forced(resolve_model("preset:tiny"), first), atol=1e-3, rtol=0)
    manager = eng._continuous._manager if eng._continuous is not None else None
    eng.load_weights(list(load_file(other_model / "model.safetensors").items()))
    other = eng.generate(PROMPTS, 4, PLAIN)
    torch.testing.assert_close(sampled(other), teacher_forced(other_model, other), atol=1e-3, rtol=0)
    if manager is not None:
        assert eng._continuous._manager is manager and manager.continuous_batching_config.use_cuda_graph == (True, True)


def test_the_generation_benchmark_runs_every_engine_path_on_cpu(tmp_path):
    """scripts/bench/generation_gpu.py's smoke run on the CPU (the tiny preset): every engine path generates the
    batch with logprobs equal to the teacher-forced pass (a GPU's numbers come from the same script)."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "scripts/bench/generation_gpu.py"), "--prompts", "2", "--n", "2",
                           "--max-new-tokens", "8", "--repeats", "1",
                           "--modes", "engine-generate,engine-continuous,engine-static,engine-compiled"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RLSERVE_BENCH_RESULTS": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "generation_gpu.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["engine-generate", "engine-continuous", "engine-static", "engine-compiled"]
    for row in rows:
        assert "error" not in row, row
        assert row["samples"] == 4 and row["tokens"] > 0 and row["max_abs_logprob_error"] < 1e-4, row
