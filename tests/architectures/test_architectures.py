"""Every supported architecture through every engine, against the model's own transformers forward.

Per architecture of `tests/support/architectures.py` (tiny random models):
- megatron: HF -> Megatron -> HF round trip is exact (TP 1 and 2), and GPTModel's logits and the
  megatron loss's logprobs match transformers within 1e-4 (CPU, world size 1; TP 2 in one spawned
  pair); architectures the backend cannot reproduce are refused with the reason instead;
- dtensor: learner logprobs (padded and packed rows) match transformers within 1e-4, one GRPO step
  runs, its export is the checkpoint layout (fused MoE experts split back) and, loaded by
  transformers, gives the learner's logprobs after the step; TP 2 (with and without sequence
  parallel) matches one rank;
- reference: the scorer's logprobs match transformers within 1e-4;
- rollout: vLLM's sampled-token logprobs match transformers within 1e-4 on the base weights and,
  after an in-place update to the learner's exported weights, on those (one engine per architecture);
  the controls: vLLM's own reload leaves CPU MoE experts and a tied head stale, the rebuild path is right.
Numbers are fp32. Measured maxima go to the JUnit report (`record_property`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from rlserve.learner.megatron.hf_map import hf_to_megatron
from rlserve.learner.megatron.support import unsupported_reasons
from rlserve.reference.scorer import ReferenceScorer, Sequence
from rlserve.weights.specs import checkpoint_specs
from tests.support.aio import LoopThread
from tests.support.architectures import (
    ARCHITECTURES,
    architecture_dir,
    dtensor_runs,
    make_architecture,
    max_diff,
    sequences,
    transformers_logits,
    transformers_logprobs,
)
from tests.support.dist import run_ranks, run_ranks_in_turn
from tests.support.megatron_convert import megatron_to_hf
from tests.support.megatron_cpu import megatron_world_size_1, model_parallel, spawn_workers  # noqa: F401 (fixture)

ATOL = 1e-4
NAMES = list(ARCHITECTURES)
RUN_LENGTH = 128  # the run's max_total_sequence_length for the megatron support check
# What the megatron backend refuses, and a word its reason must contain.
MEGATRON_REFUSED = {"gemma2": "soft-capping", "gemma3": "Gemma3", "mistral-window": "sliding_window"}


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("architectures")
    for name in NAMES:
        architecture_dir(name, str(path))
    return str(path)


@pytest.fixture(scope="module")
def expected(root) -> dict[str, list[list[float]]]:
    """transformers' logprobs of `sequences()` on each base model."""
    return {name: transformers_logprobs(architecture_dir(name, root), sequences()) for name in NAMES}


# --- megatron -----------------------------------------------------------------------------------

def _megatron_logprobs(name: str, root: str, tp: int) -> tuple[torch.Tensor, list[list[float]]]:
    """GPTModel's full-vocab logits of `sequences()[0]`, and the megatron loss path's logprobs of every
    sequence (final hidden states from the deferred output layer, projected by `vocab_parallel_logprobs`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlserve.learner.megatron.forward import defer_output_layer, output_weight, vocab_parallel_logprobs
    from rlserve.learner.megatron.model import build_gpt_model, load_megatron_state, megatron_config_from_hf

    path = architecture_dir(name, root)
    config = AutoConfig.from_pretrained(path)
    tc = megatron_config_from_hf(config, max_sequence_length=RUN_LENGTH, use_cpu_initialization=True,
                                 perform_initialization=False, tensor_model_parallel_size=tp)
    gpt = build_gpt_model(config, tc).eval()
    load_megatron_state(gpt, hf_to_megatron(load_file(str(path / "model.safetensors")), config, tp,
                                            ps.get_tensor_model_parallel_rank()))

    def forward(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return gpt(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None],
                       attention_mask=None)[0]

    logits = forward(sequences()[0][0])
    if tp > 1:
        pieces = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(pieces, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(pieces, dim=-1)
    defer_output_layer(gpt)
    logprobs = []
    for ids, p in sequences():
        hidden = forward(ids)
        with torch.no_grad():
            logprobs.append(vocab_parallel_logprobs(hidden[p - 1:-1], output_weight(gpt), torch.tensor(ids[p:]),
                                                    config.vocab_size, with_entropy=False)[0].tolist())
    return logits[..., :config.vocab_size], logprobs


@pytest.mark.parametrize("name", NAMES)
def test_megatron_round_trip_and_logprobs(name, root, expected, megatron_world_size_1, record_property):
    path = architecture_dir(name, root)
    config = AutoConfig.from_pretrained(path)
    reasons = unsupported_reasons(config, RUN_LENGTH)
    if name in MEGATRON_REFUSED:
        assert reasons and MEGATRON_REFUSED[name] in " ".join(reasons), reasons
        return
    assert not reasons, reasons
    state = load_file(str(path / "model.safetensors"))
    for tp in (1, 2):
        shards = [hf_to_megatron(state, config, tp, r) for r in range(tp)]
        back = megatron_to_hf(shards, config, tp)
        assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state), tp
    logits, logprobs = _megatron_logprobs(name, root, tp=1)
    logits_diff = (logits - transformers_logits(path, sequences()[0][0])).abs().max().item()
    diff = max_diff(logprobs, expected[name])
    record_property("megatron_logits_max_abs_diff", logits_diff)
    record_property("megatron_logprob_max_abs_diff", diff)
    assert logits_diff < ATOL and diff < ATOL


def _megatron_tp2(rank: int, world: int, names: list[str], root: str) -> dict:
    out = {}
    for name in names:
        with model_parallel(tp=2):
            out[name] = _megatron_logprobs(name, root, tp=2)[1]
    return out


def test_megatron_tp2_matches_transformers(root, expected, record_property):
    """TP 2 splits Phi3's fused projections, Qwen3's q/k-normed heads and the MoE experts' FFNs."""
    names = [n for n in NAMES if n not in MEGATRON_REFUSED and n not in ("llama", "mistral")]
    results = spawn_workers(_megatron_tp2, 2, names, root)
    for name in names:
        for rank in range(2):
            diff = max_diff(results[rank][name], expected[name])
            record_property(f"megatron_tp2_{name}_rank{rank}", diff)
            assert diff < ATOL, (name, rank, diff)


# --- dtensor learner and reference --------------------------------------------------------------

@pytest.fixture(scope="module")
def dtensor_one_rank(root) -> dict:
    """All architectures on one gloo rank (one spawned process): logprobs, a step, the export."""
    (result,) = run_ranks(1, dtensor_runs, NAMES, root, 1, False, True)
    return result


@pytest.mark.parametrize("name", NAMES)
def test_dtensor_logprobs_step_and_export(name, root, expected, dtensor_one_rank, record_property):
    run = dtensor_one_rank[name]
    for layout in ("padded", "packed"):
        diff = max_diff(run["before"][layout], expected[name])
        record_property(f"dtensor_{layout}_logprob_max_abs_diff", diff)
        assert diff < ATOL, (layout, diff)
    base, stepped = architecture_dir(name, root), architecture_dir(f"{name}-step", root)
    want, got = checkpoint_specs(base), checkpoint_specs(stepped)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    # The export is the trained model: transformers on it gives the learner's logprobs after the step.
    after = transformers_logprobs(stepped, sequences())
    assert max_diff(after, expected[name]) > 1e-3  # the step changed the weights
    diff = max_diff(run["after"], after)
    record_property("dtensor_export_logprob_max_abs_diff", diff)
    assert diff < ATOL


@pytest.mark.parametrize("name", NAMES)
def test_reference_logprobs(name, root, expected, record_property):
    scorer = ReferenceScorer(architecture_dir(name, root))
    got = scorer.logprobs([Sequence(ids, p) for ids, p in sequences()])
    diff = max_diff(got, expected[name])
    record_property("reference_logprob_max_abs_diff", diff)
    assert diff < ATOL


def test_gemma2_needs_eager_attention_and_final_softcapping(root, expected):
    """The controls: transformers' default (SDPA) attention, or logits without the cap, are not Gemma2."""
    from transformers import AutoModelForCausalLM

    path = architecture_dir("gemma2", root)
    sdpa = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids, p = sequences()[0]
    with torch.no_grad():
        out = sdpa(input_ids=torch.tensor([ids]), output_hidden_states=True)
        lp = out.logits[0].log_softmax(-1)
        uncapped = (out.hidden_states[-1][0] @ sdpa.lm_head.weight.t()).log_softmax(-1)
    pick = lambda t: [[float(t[i - 1, ids[i]]) for i in range(p, len(ids))]]  # noqa: E731
    assert max_diff(pick(lp), expected["gemma2"][:1]) > 1e-3
    assert max_diff(pick(uncapped), expected["gemma2"][:1]) > 1e-2


TP2_NAMES = [n for n in NAMES if n != "mistral"]  # mistral's plan is llama's


@pytest.fixture(scope="module")
def dtensor_two_ranks(root) -> dict[bool, list]:
    """Per rank, TP 2's runs without and with sequence parallelism, in one spawned pair, one after the other."""
    return run_ranks_in_turn(2, {sp: (dtensor_runs, TP2_NAMES, root, 2, sp, False) for sp in (False, True)})


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_dtensor_tp2_matches_one_rank(sp, dtensor_two_ranks, dtensor_one_rank, record_property):
    """Every architecture's TP plan (whole fused/MoE blocks, sandwich norms under SP) equals one rank."""
    names = TP2_NAMES
    results = dtensor_two_ranks[sp]
    for name in names:
        for rank in range(2):
            one, two = dtensor_one_rank[name], results[rank][name]
            before = max_diff(two["before"]["padded"], one["before"]["padded"])
            after = max_diff(two["after"], one["after"])
            record_property(f"dtensor_{'tp2_sp' if sp else 'tp2'}_{name}_rank{rank}", before)
            record_property(f"dtensor_{'tp2_sp' if sp else 'tp2'}_after_step_{name}_rank{rank}", after)
            assert before < 2e-5 and after < 2e-5, (name, rank, before, after)
            assert two["loss"] == pytest.approx(one["loss"], abs=ATOL)
            # Adam's first step is lr * sign(grad): a partial gradient (a replicated weight whose
            # gradient TP ranks did not sum) hides in the weights, not in the gradient norm.
            assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), name


# --- rollout (vLLM CPU) ---------------------------------------------------------------------------

def _engine_error(loop, engine, path, prompts) -> float:
    from rlserve.rollout.interfaces import SamplingSpec

    out = loop.run(engine.generate(prompts, 2, SamplingSpec(temperature=1.0, max_new_tokens=12, seed=3)))
    seqs = [(p + s.token_ids, len(p)) for p, ss in zip(prompts, out) for s in ss]
    return max_diff([s.logprobs for ss in out for s in ss], transformers_logprobs(path, seqs))


def _start(loop, name: str, **settings):
    from rlserve.rollout import make_engine
    from rlserve.rollout.interfaces import EngineConfig

    async def start():
        return make_engine(name, EngineConfig(max_model_len=64, **settings))

    return loop.run(start())


@pytest.fixture(scope="module")
def vllm_engine(request, root, loop) -> Iterator:
    """A vLLM engine started on the base weights of the architecture `request.param`, shared by that
    architecture's tests (indirect parametrization by name: pytest runs them one after the other, one
    engine start each; the in-place update, which needs the base weights, comes first)."""
    engine = _start(loop, "vllm", model_path=architecture_dir(request.param, root))
    yield engine
    loop.run(engine.close())


def _far_weights(name: str, root: str) -> Path:
    """Another random model of `name`, far from the base (a stale part shows)."""
    path = Path(root) / f"{name}-seed7"
    return path if (path / "config.json").is_file() else make_architecture(name, path, seed=7)


@pytest.mark.parametrize("vllm_engine", NAMES, indirect=True)
def test_vllm_logprobs_before_and_after_in_place_update(vllm_engine, root, loop, dtensor_one_rank, record_property):
    engine = vllm_engine
    name = Path(engine.cfg.model_path).name
    base, stepped = architecture_dir(name, root), architecture_dir(f"{name}-step", root)
    prompts = [ids[:p + 4] for ids, p in sequences()]
    assert engine.reload_mode == "in_place" and engine.version == 0
    diff = _engine_error(loop, engine, base, prompts)
    record_property("vllm_base_logprob_max_abs_diff", diff)
    assert diff < ATOL
    loop.run(engine.load_weights(list(load_file(str(stepped / "model.safetensors")).items()), 1, False))
    diff = _engine_error(loop, engine, stepped, prompts)
    record_property("vllm_reloaded_logprob_max_abs_diff", diff)
    assert diff < ATOL
    assert _engine_error(loop, engine, base, prompts) > 1e-3  # it serves the new weights, not the old


@pytest.mark.parametrize("vllm_engine", ["mixtral", "llama3-tied"], indirect=True)
def test_vllm_plain_reload_is_stale(vllm_engine, root, loop):
    """The control: vLLM's own reload leaves CPU MoE experts / a tied head stale, where rlserve's in-place
    update (the test above, on this same engine) is right."""
    other = _far_weights(Path(vllm_engine.cfg.model_path).name, root)
    prompts = [ids[:p + 4] for ids, p in sequences()]
    loop.run(vllm_engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(other)}))
    loop.run(vllm_engine.llm.reset_prefix_cache())
    assert _engine_error(loop, vllm_engine, other, prompts) > 1e-2


def test_vllm_rebuild_is_right(root, loop):
    """`weight_reload: rebuild`, which replaces the engine by one started on the new weights, serves them
    right where vLLM's own reload leaves them stale (CPU MoE experts). One architecture: the rebuild is a
    fresh start on a folder of the new weights, the same code for each, and every architecture's fresh
    start is checked by its in-place test."""
    base, other = architecture_dir("mixtral", root), _far_weights("mixtral", root)
    prompts = [ids[:p + 4] for ids, p in sequences()]
    rebuilt = _start(loop, "vllm", model_path=base, weight_reload="rebuild")
    try:
        assert rebuilt.reload_mode == "rebuild" and rebuilt.transfer_backend is None
        loop.run(rebuilt.load_weights_from_path(other, 1, False))
        assert rebuilt.version == 1
        assert _engine_error(loop, rebuilt, other, prompts) < ATOL
    finally:
        loop.run(rebuilt.close())


@pytest.mark.parametrize("name", NAMES)
def test_transformers_engine_in_place_update(name, root, loop, dtensor_one_rank, record_property):
    """The transformers engine takes checkpoint-named updates too (fused MoE experts filled in place)."""
    base, stepped = architecture_dir(name, root), architecture_dir(f"{name}-step", root)
    prompts = [ids[:p + 4] for ids, p in sequences()]
    engine = _start(loop, "transformers", model_path=base)
    assert _engine_error(loop, engine, base, prompts) < ATOL
    loop.run(engine.load_weights(list(load_file(str(stepped / "model.safetensors")).items()), 1, False))
    diff = _engine_error(loop, engine, stepped, prompts)
    record_property("transformers_engine_reloaded_logprob_max_abs_diff", diff)
    assert diff < ATOL
