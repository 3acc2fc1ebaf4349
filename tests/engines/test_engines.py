"""The rollout engines themselves (no services): vLLM's CPU build (AsyncLLM) and transformers agree
with teacher-forced transformers logprobs; weight updates switch models exactly, also while requests
run (in flight, through vLLM's weight-transfer API on the project's gloo engine) or after they drain."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from rlserve.models import resolve_model
from rlserve.models.factory import make_model
from rlserve.models.presets import get_preset
from rlserve.reference.scorer import ReferenceScorer, Sequence
from rlserve.rollout import make_engine
from rlserve.rollout.interfaces import EngineConfig, SamplingSpec
from rlserve.weights.digest import differences, folder_digests
from tests.support.aio import LoopThread

PROMPTS = [[8, 11, 41, 12, 9, 47], [5, 6, 42, 7], [30, 31, 32]]
# Long enough that an update issued a moment after the start lands in the middle.
LONG = SamplingSpec(temperature=1.0, max_new_tokens=200, min_new_tokens=200, seed=7)


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def vllm_engine(loop):
    async def start():
        return make_engine("vllm", EngineConfig(model_path=resolve_model("preset:tiny")))

    engine = loop.run(start())
    yield engine
    loop.run(engine.close())


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return make_model(get_preset("tiny"), tmp_path_factory.mktemp("other") / "other", seed=99)


def logprob_errors(prompts, engine_out, model_path) -> list[list[float]]:
    """|engine logprob - transformers logprob| per token of every sample."""
    seqs = [Sequence(p + s.token_ids, len(p)) for p, ss in zip(prompts, engine_out) for s in ss]
    ref = ReferenceScorer(model_path).logprobs(seqs)
    gen = [s.logprobs for ss in engine_out for s in ss]
    assert all(len(r) == len(g) > 0 for r, g in zip(ref, gen))
    return [[abs(a - b) for a, b in zip(r, g)] for r, g in zip(ref, gen)]


def max_logprob_error(engine_out, model_path) -> float:
    return max(max(e) for e in logprob_errors(PROMPTS, engine_out, model_path))


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_sampled_logprobs_match_transformers(engine, vllm_engine, loop):
    async def run():
        eng = vllm_engine if engine == "vllm" else make_engine(engine, EngineConfig(model_path=resolve_model("preset:tiny")))
        return await eng.generate(PROMPTS, 4, SamplingSpec(temperature=1.0, max_new_tokens=8, seed=3))

    out = loop.run(run())
    assert [len(ss) for ss in out] == [4, 4, 4]
    assert all(s.finish_reason in ("stop", "length") for ss in out for s in ss)
    assert all([(r.start, r.end) for r in s.version_runs] == [(0, len(s.token_ids))] and s.oldest_version == 0
               for ss in out for s in ss)
    assert max_logprob_error(out, resolve_model("preset:tiny")) < 1e-4


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_with_top_p_and_top_k_the_logprobs_are_the_full_distributions_as_the_learners(engine, vllm_engine, loop):
    """Sampling exactness: with temperature, top-p and top-k cutting the sampling distribution, both engines
    still return each sampled token's logprob under the model's own temperature-1 distribution over the
    whole vocabulary, which is what the learner (and the reference scorer) compute: equal within 1e-4. The
    sampler's renormalised logprob (over the kept tokens, at the temperature) is not it, by far."""
    cut = SamplingSpec(temperature=0.7, top_p=0.8, top_k=5, max_new_tokens=8, seed=4)

    async def run():
        eng = vllm_engine if engine == "vllm" else make_engine(engine, EngineConfig(model_path=resolve_model("preset:tiny")))
        return await eng.generate(PROMPTS, 4, cut)

    out = loop.run(run())
    model = resolve_model("preset:tiny")
    assert max_logprob_error(out, model) < 1e-4
    # What the sampler drew from: temperature, then the top-k and top-p cuts, renormalised.
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    gaps = []
    with torch.no_grad():
        for prompt, samples in zip(PROMPTS, out):
            for s in samples:
                seq = torch.tensor([prompt + s.token_ids])
                logits = lm(seq).logits[0, len(prompt) - 1:-1].float() / cut.temperature
                kept = logits.topk(cut.top_k, dim=-1)
                probs = kept.values.softmax(-1)
                nucleus = (probs.cumsum(-1) - probs) < cut.top_p  # the smallest set reaching top_p
                renormalised = torch.where(nucleus, kept.values, float("-inf")).log_softmax(-1)
                picked = (kept.indices == torch.tensor(s.token_ids)[:, None])
                assert picked.any(-1).all(), "a sampled token outside the top-k"
                gaps += (renormalised[picked] - torch.tensor(s.logprobs)).tolist()
    assert min(gaps) >= -1e-4 and sum(gaps) / len(gaps) > 0.1, gaps


def test_the_transformers_engine_digests_exactly_the_weights_it_loaded(loop, other_model, tmp_path):
    """What `GetInfo(weight_digests)` answers: the served weights by checkpoint name, equal to the folder
    they came from (cast to the engine's dtype), and a last-bit change in one tensor named."""
    tied_cfg = replace(get_preset("tiny"), tie_word_embeddings=True)
    for start, new in ((resolve_model("preset:tiny"), other_model),
                       (make_model(tied_cfg, tmp_path / "tied"), make_model(tied_cfg, tmp_path / "new", seed=5))):
        engine = make_engine("transformers", EngineConfig(model_path=start, dtype="bfloat16"))
        loop.run(engine.load_weights_from_path(new, 7, in_flight=False))
        version, served = loop.run(engine.weight_digests())
        assert version == 7 and not differences(folder_digests(new, torch.bfloat16), served)
        assert differences(folder_digests(start, torch.bfloat16), served)
        state = load_file(new / "model.safetensors")
        name = sorted(state)[-1]
        state[name] = state[name].to(torch.bfloat16)
        state[name].view(-1)[0] = state[name].view(-1)[0].view(torch.int16).add(1).view(torch.bfloat16)
        loop.run(engine.load_weights(list(state.items()), 8, in_flight=False))
        version, served = loop.run(engine.weight_digests())
        assert version == 8 and differences(folder_digests(new, torch.bfloat16), served) == [f"{name}: differs"]


def test_vllm_cannot_digest_its_weights_and_says_so(vllm_engine, loop):
    with pytest.raises(NotImplementedError, match="cannot digest"):
        loop.run(vllm_engine.weight_digests())


def test_concurrent_requests_share_the_engine(vllm_engine, loop):
    """Many calls at once run together (the engine batches them); seeds still repeat exactly."""
    seeded = SamplingSpec(temperature=1.0, max_new_tokens=6, seed=11)

    async def run():
        return await asyncio.gather(*(vllm_engine.generate(PROMPTS, 2, seeded) for _ in range(8)))

    outs = loop.run(run())
    assert all(o == outs[0] for o in outs)
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=6)
    assert loop.run(vllm_engine.generate(PROMPTS, 1, greedy)) == loop.run(vllm_engine.generate(PROMPTS, 1, greedy))


def test_seeded_sampling_of_a_batch_beyond_one_scheduler_step(vllm_engine, loop):
    """64 prompts x 8 samples x 40 tokens (20k prompt tokens, several scheduler steps) with seeds,
    as a GRPO step with chat-template prompts sends them; vLLM's CPU backend used to fail here.
    (Before any test that starts a second engine: its teardown leaves this one unusable.)"""
    prompts = [[5 + (i + j) % 40 for j in range(40)] for i in range(64)]
    out = loop.run(vllm_engine.generate(prompts, 8, SamplingSpec(temperature=1.0, max_new_tokens=4, seed=7)))
    assert [len(ss) for ss in out] == [8] * 64 and all(len(s.token_ids) > 0 for ss in out for s in ss)


def test_update_from_the_store_switches_models_exactly(vllm_engine, loop, other_model):
    base = resolve_model("preset:tiny")
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=8, seed=5)
    try:
        loop.run(vllm_engine.load_weights(list(load_file(other_model / "model.safetensors").items()), 1, False))
        out = loop.run(vllm_engine.generate(PROMPTS, 2, sampling))
        assert {s.oldest_version for ss in out for s in ss} == {1}
        assert max_logprob_error(out, other_model) < 1e-4
        assert max_logprob_error(out, base) > 1e-2  # the test would notice stale weights
    finally:
        loop.run(vllm_engine.load_weights_from_path(base, 2, False))
    out = loop.run(vllm_engine.generate(PROMPTS, 2, sampling))
    assert max_logprob_error(out, base) < 1e-4


class LocalClient:
    """vLLM's weight-sync client for an engine in this process (the service uses the fleet)."""

    def __init__(self, engine, loop: LoopThread, version: int):
        self.engine, self.loop, self.version = engine, loop, version

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.loop.run(self.engine.init_weight_transfer(init_info))

    def start_weight_update(self) -> None:
        self.loop.run(self.engine.start_weight_update(True))

    def update_weights(self, update_info: dict) -> None:
        self.loop.run(self.engine.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.loop.run(self.engine.finish_weight_update(self.version, True))


class TensorSource:
    """vLLM's WeightSource over a dict of tensors (the learner's is an export walk)."""

    def __init__(self, tensors):
        self.tensors = list(tensors.items())

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors]

    def __iter__(self):
        return iter(self.tensors)


def test_in_flight_direct_update_continues_running_requests_on_the_new_weights(vllm_engine, loop, other_model):
    """The learner's path on CPU: the gloo engine sends while requests run; they continue on the new weights,
    each sample says where the switch fell, and every token's logprob is exactly its version's."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from rlserve.weights import gloo_transfer

    gloo_transfer.register_sender()
    base = resolve_model("preset:tiny")
    version = vllm_engine.version + 1
    running = loop.submit(vllm_engine.generate(PROMPTS, 4, LONG))
    while vllm_engine.stats().requests_running == 0:
        time.sleep(0.01)
    time.sleep(0.3)
    info = gloo_transfer.GlooTrainerInitInfo(rank=0, world_size=2, session=uuid.uuid4().hex, timeout_s=60)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=LocalClient(vllm_engine, loop, version),
        source=TensorSource(load_file(other_model / "model.safetensors")))
    trainer.send_weights()
    assert trainer.failed_ranks == set()
    out = running.result(600)
    try:
        samples = [s for ss in out for s in ss]
        assert all(len(s.token_ids) == 200 and s.finish_reason == "length" for s in samples)  # nothing aborted
        mixed = [s for s in samples if len(s.version_runs) == 2]
        assert mixed, "the update should land while the samples were generating"
        errors_old = logprob_errors(PROMPTS, out, base)
        errors_new = logprob_errors(PROMPTS, out, other_model)
        for s, e_old, e_new in zip(samples, errors_old, errors_new):
            runs = s.version_runs
            assert runs[-1].version == version and runs[-1].end == len(s.token_ids)
            for run in runs:
                errors = e_new if run.version == version else e_old
                assert max(errors[run.start:run.end]) < 1e-4, (run, max(errors[run.start:run.end]))
        switch = mixed[0].version_runs[1].start
        assert max(errors_old[samples.index(mixed[0])][switch:]) > 1e-2  # the test would notice stale weights
    finally:
        loop.run(vllm_engine.load_weights_from_path(base, version + 1, False))


def test_update_without_in_flight_waits_for_running_requests(vllm_engine, loop, other_model):
    """in_flight off: running samples finish on the old weights (one version each); later ones use the new."""
    base = resolve_model("preset:tiny")
    old = vllm_engine.version
    running = loop.submit(vllm_engine.generate(PROMPTS, 2, replace(LONG, max_new_tokens=60, min_new_tokens=60)))
    while vllm_engine.stats().requests_running < len(PROMPTS):
        time.sleep(0.01)
    time.sleep(0.3)  # scheduled, not only submitted: the pause waits for running requests
    try:
        loop.run(vllm_engine.load_weights(list(load_file(other_model / "model.safetensors").items()), old + 1, False))
        before = running.result(600)
        assert all([r.version for r in s.version_runs] == [old] for ss in before for s in ss)
        assert max_logprob_error(before, base) < 1e-4
        after = loop.run(vllm_engine.generate(PROMPTS, 2, SamplingSpec(temperature=1.0, max_new_tokens=8)))
        assert all(s.oldest_version == old + 1 for ss in after for s in ss)
        assert vllm_engine.stats().paused_s > 0
    finally:
        loop.run(vllm_engine.load_weights_from_path(base, old + 2, False))


def test_an_in_flight_update_can_keep_the_kv_cache_and_later_requests_get_the_new_weights(loop, other_model):
    """`in_flight_kv_cache: keep` (PipelineRL's semantics): running requests continue on the new weights
    over the keys/values older weights computed, so their tokens after the switch are not the new
    model's teacher-forced logprobs; a request that starts after the update never reuses those cached
    blocks, even for the same prompt. The engine also runs on the cores it was given."""
    import os

    import psutil

    base = resolve_model("preset:tiny")
    mine = os.sched_getaffinity(0)
    others = {p.pid for p in psutil.Process().children(recursive=True)}  # the module's engine

    async def start():
        return make_engine("vllm", EngineConfig(model_path=base, in_flight_kv_cache="keep", cpu_cores=(0,)))

    engine = loop.run(start())
    try:
        vllm_procs = [p for p in psutil.Process().children(recursive=True)
                      if p.pid not in others and p.name().startswith("VLLM")]
        assert vllm_procs and all(p.cpu_affinity() == [0] for p in vllm_procs), \
            [(p.name(), p.cpu_affinity()) for p in vllm_procs]
        assert {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")} == {frozenset(mine)}
        running = loop.submit(engine.generate(PROMPTS, 4, LONG))
        while engine.stats().requests_running < len(PROMPTS):
            time.sleep(0.01)
        time.sleep(0.3)
        loop.run(engine.load_weights(list(load_file(other_model / "model.safetensors").items()), 1, True))
        later = loop.run(engine.generate(PROMPTS, 2, SamplingSpec(temperature=1.0, max_new_tokens=8, seed=2)))
        assert not running.done(), "the later request should run while the long ones still hold their blocks"
        assert all(s.oldest_version == 1 for ss in later for s in ss)
        assert max_logprob_error(later, other_model) < 1e-4
        out = running.result(600)
        samples = [s for ss in out for s in ss]
        assert all(len(s.token_ids) == 200 for s in samples)
        mixed = [s for s in samples if [r.version for r in s.version_runs] == [0, 1]]
        assert mixed, "the update should land while the samples were generating"
        errors_old, errors_new = logprob_errors(PROMPTS, out, base), logprob_errors(PROMPTS, out, other_model)
        for s in mixed:
            i, switch = samples.index(s), s.version_runs[1].start
            assert max(errors_old[i][:switch]) < 1e-4
            assert max(errors_old[i][switch:]) > 1e-2  # new weights after the switch...
            assert max(errors_new[i][switch:]) > 1e-3  # ...over the old keys and values (nothing recomputed)
    finally:
        loop.run(engine.close())


def test_direct_update_of_a_tied_model_is_exact(tmp_path, loop):
    """vLLM's CPU backend packs a tied output layer apart from the embedding; the gloo transfer's load
    re-packs it (rlserve.rollout.vllm_reload), so the new weights serve exactly, head included."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from rlserve.weights import gloo_transfer

    gloo_transfer.register_sender()
    tied_cfg = replace(get_preset("tiny"), tie_word_embeddings=True)
    tied, other = make_model(tied_cfg, tmp_path / "tied"), make_model(tied_cfg, tmp_path / "other", seed=5)
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=8, seed=3)

    async def start():
        return make_engine("vllm", EngineConfig(model_path=tied))

    engine = loop.run(start())
    try:
        assert engine.transfer_backend == "gloo" and engine.reload_mode == "in_place"
        info = gloo_transfer.GlooTrainerInitInfo(rank=0, world_size=2, session=uuid.uuid4().hex, timeout_s=60)
        trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=LocalClient(engine, loop, 1), source=TensorSource(load_file(other / "model.safetensors")))
        trainer.send_weights()
        assert trainer.failed_ranks == set()
        out = loop.run(engine.generate(PROMPTS, 2, sampling))
        assert max_logprob_error(out, other) < 1e-4
        assert max_logprob_error(out, tied) > 1e-2
    finally:
        loop.run(engine.close())


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


def test_the_engine_process_ends_when_its_replica_is_killed(tmp_path):
    """A replica SIGKILLed (lost node, OOM kill) must not leave vLLM's engine core holding the model."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    ready = tmp_path / "ready"
    script = ("import pathlib, time\n"
              "from rlserve.models import resolve_model\n"
              "from rlserve.rollout import make_engine\n"
              "from rlserve.rollout.interfaces import EngineConfig\n"
              "engine = make_engine('vllm', EngineConfig(model_path=resolve_model('preset:tiny')))\n"
              f"pathlib.Path({str(ready)!r}).touch()\n"
              "time.sleep(600)\n")
    replica = subprocess.Popen([sys.executable, "-c", script], env=os.environ)
    try:
        deadline = time.time() + 300
        while not ready.exists():
            assert replica.poll() is None and time.time() < deadline, "the engine did not start"
            time.sleep(0.5)
        engine_procs = psutil.Process(replica.pid).children(recursive=True)
        assert engine_procs, "AsyncLLM runs its engine core in a child process"
        replica.send_signal(signal.SIGKILL)
        replica.wait()
        _, alive = psutil.wait_procs(engine_procs, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:
        if replica.poll() is None:
            replica.kill()
