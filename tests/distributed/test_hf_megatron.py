"""HF <-> Megatron-Core conversion: exact round trips and logits equal to transformers'.

Round trips are pure tensor code. Logits run megatron's GPTModel (local spec,
fp32) on the CPU with the patches of `tests/support/megatron_cpu.py`: in this
process for world size 1, and in 2 spawned gloo processes for TP 2 and EP 2.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

from rlserve.learner.megatron.hf_map import hf_to_megatron, megatron_param_to_hf, padded_vocab_size, tp_split_dim
from rlserve.models import resolve_model
from tests.support.megatron_convert import iter_megatron_to_hf, megatron_to_hf
from tests.support.megatron_cpu import megatron_world_size_1, model_parallel, spawn_workers  # noqa: F401 (fixture)

ATOL = 1e-4


def _synthetic(config, seed: int):
    """Checkpoint-named state of a random HF model that is not a preset."""
    torch.manual_seed(seed)
    state = AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict()
    out = {}
    for k, v in state.items():
        if k == "lm_head.weight" and config.tie_word_embeddings:
            continue
        # HF initialises biases to 0 and norms to 1; random values make their layout visible.
        out[k] = v + 0.1 * torch.randn_like(v) if k.endswith(("bias", "norm.weight")) else v.detach().clone()
    return out


_SMALL = dict(vocab_size=62, hidden_size=64, intermediate_size=96, max_position_embeddings=64)
SYNTHETIC = {
    # 8 heads / 2 KV groups at TP 4 (a group spans two ranks), vocab 62 padded to 64.
    "gqa8": LlamaConfig(**_SMALL, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                        tie_word_embeddings=False),
    # One KV group at TP 2: megatron all-gathers the fused QKV and re-slices it per rank.
    "mqa": LlamaConfig(**_SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                       tie_word_embeddings=False),
    # q/k/v biases, tied embeddings.
    "qwen2": Qwen2Config(**_SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True),
}


@functools.cache
def model(name: str) -> tuple[object, dict[str, torch.Tensor], Path | None]:
    """(HF config, checkpoint-named state, folder or None) for a preset or a synthetic config."""
    if name in SYNTHETIC:
        return SYNTHETIC[name], _synthetic(SYNTHETIC[name], seed=3), None
    path = resolve_model(f"preset:{name}")
    return AutoConfig.from_pretrained(path), load_file(str(path / "model.safetensors")), path


def hf_logits(name: str, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    config, state, path = model(name)
    if path is not None:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        hf.load_state_dict(state, strict=not config.tie_word_embeddings)
        hf.tie_weights()
    with torch.no_grad():
        return hf.eval()(input_ids=ids, attention_mask=attention_mask).logits


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b) or sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:8]
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# (tp, ep, etp, ranks): ranks=None is one shard per (ep, tp) pair; otherwise (tp_rank, ep_rank, etp_rank) per shard.
LAYOUTS = {
    "tiny": [(1, 1, None, None), (2, 1, None, None)],
    "gqa8": [(1, 1, None, None), (2, 1, None, None), (4, 1, None, None)],
    "qwen2": [(1, 1, None, None), (2, 1, None, None)],
    "mqa": [(2, 1, None, None)],
    "moe-tiny": [
        (1, 1, None, None), (2, 1, None, None), (1, 2, None, None), (1, 4, None, None),
        (2, 2, None, None),  # 4 ranks, ETP = TP = 2
        (2, 2, 1, [(0, 0, 0), (1, 1, 0)]),  # 2 ranks: TP 2 for dense, EP 2 x ETP 1 for experts
    ],
}


def shard_all(name, tp, ep, etp, ranks):
    config, state, _ = model(name)
    coords = ranks or [(r % tp, r // tp, r % tp) for r in range(tp * ep)]
    return [hf_to_megatron(state, config, tp, t, ep, e, etp_size=etp, etp_rank=et) for t, e, et in coords]


@pytest.mark.parametrize("name,tp,ep,etp,ranks", [(n, *layout) for n, layouts in LAYOUTS.items() for layout in layouts])
def test_round_trip_is_exact(name, tp, ep, etp, ranks):
    config, state, _ = model(name)
    shards = shard_all(name, tp, ep, etp, ranks)
    assert_same(megatron_to_hf(shards, config, tp, ep, etp_size=etp, ranks=ranks), state)


def test_shard_shapes_and_split_dims():
    config, state, _ = model("moe-tiny")
    full, halves = hf_to_megatron(state, config, 1, 0), [hf_to_megatron(state, config, 2, r) for r in range(2)]
    assert sorted(full) == sorted(halves[0])
    for k, t in full.items():
        dim = tp_split_dim(k)
        for h in halves:
            expected = list(t.shape)
            if dim is not None:
                expected[dim] //= 2
            assert list(h[k].shape) == expected, k
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    # Group 0 is q heads 0-1, then k head 0, then v head 0 (head_dim 32).
    assert torch.equal(qkv[:64], q[:64]) and torch.equal(qkv[64:96], k[:32]) and torch.equal(qkv[96:128], v[:32])
    fc1 = halves[1]["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    w1, w3 = (state[f"model.layers.0.block_sparse_moe.experts.3.{w}.weight"] for w in ("w1", "w3"))
    assert torch.equal(fc1, torch.cat([w1[128:], w3[128:]]))  # [gate_t; up_t] on TP rank 1


def test_per_parameter_export_matches_whole_model():
    config, state, _ = model("moe-tiny")
    shards = [hf_to_megatron(state, config, 1, 0, 2, e) for e in range(2)]
    name = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"
    (hf_name, tensor), = megatron_param_to_hf(name, [shards[1][name]], config, ep_size=2, ep_rank=1)
    assert hf_name == "model.layers.1.block_sparse_moe.experts.2.w2.weight" and torch.equal(tensor, state[hf_name])
    streamed = [n for n, _ in iter_megatron_to_hf(shards, config, 1, 2)]
    assert len(streamed) == len(set(streamed)) == len(state)


def test_tied_vocab_padding_and_te_names():
    config, state, _ = model("qwen2")  # tied embeddings
    assert "lm_head.weight" not in state
    shard = hf_to_megatron(state, config, 1, 0, vocab_size=padded_vocab_size(config.vocab_size, 1, 128), use_te=True)
    assert "output_layer.weight" not in shard
    assert shard["embedding.word_embeddings.weight"].shape[0] == 128
    assert not shard["embedding.word_embeddings.weight"][config.vocab_size:].any()
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in shard
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in shard
    back = megatron_to_hf([shard], config, 1, use_te=True)
    assert_same(back, state)
    assert back["model.embed_tokens.weight"].untyped_storage().nbytes() == back["model.embed_tokens.weight"].nbytes


def test_bad_names_raise():
    config, state, _ = model("tiny")
    with pytest.raises(KeyError):
        hf_to_megatron({**state, "model.layers.9.mlp.up_proj.weight": state["model.norm.weight"]}, config, 1, 0)
    with pytest.raises(KeyError):
        megatron_to_hf([{"decoder.layers.0.bogus.weight": torch.zeros(1)}], config, 1)


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(7))


def _megatron_logits(name: str, ids: torch.Tensor, tp: int = 1, ep: int = 1, etp: int | None = None) -> torch.Tensor:
    """Full-vocab logits of the converted GPTModel on this rank's shard (gathered over TP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlserve.learner.megatron.model import build_gpt_model, load_megatron_state, megatron_config_from_hf

    config, state, _ = model(name)
    tc = megatron_config_from_hf(config, use_cpu_initialization=True, perform_initialization=False,
                                 tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    gpt = build_gpt_model(config, tc).eval()
    shard = hf_to_megatron(state, config, tp, ps.get_tensor_model_parallel_rank(), ep,
                           ps.get_expert_model_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
                           etp_rank=ps.get_expert_tensor_parallel_rank())
    load_megatron_state(gpt, shard)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():  # attention_mask=None: the local spec's default causal mask
        logits = gpt(input_ids=ids, position_ids=positions, attention_mask=None)  # vocab-parallel
    if tp > 1:
        pieces = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(pieces, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(pieces, dim=-1)
    return logits[..., : config.vocab_size]


@pytest.mark.parametrize("name", ["tiny", "moe-tiny", "qwen2"])
def test_logits_match_transformers_world_size_1(name, megatron_world_size_1):
    config, _, _ = model(name)
    ids = _batch(config.vocab_size)
    ids[1, 12:] = config.pad_token_id or 0  # right padding: causal attention leaves the real tokens alone
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    expected = hf_logits(name, ids, mask)
    got = _megatron_logits(name, ids)
    assert got.shape == expected.shape
    assert (got[0] - expected[0]).abs().max() < ATOL
    assert (got[1, :12] - expected[1, :12]).abs().max() < ATOL


# (model, tp, ep, etp) on 2 ranks; etp None means ETP = TP.
PARALLEL_CASES = [
    ("tiny", 2, 1, None), ("mqa", 2, 1, None), ("qwen2", 2, 1, None),
    ("moe-tiny", 2, 1, None), ("moe-tiny", 1, 2, None), ("moe-tiny", 2, 2, 1),
]


def _parallel_worker(rank: int, world_size: int, ids: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for name, tp, ep, etp in PARALLEL_CASES:
        with model_parallel(tp, ep, etp):
            out.append(_megatron_logits(name, ids, tp, ep, etp))
    return out


def test_logits_match_transformers_two_ranks():
    """TP 2 (dense, MQA, Qwen2, MoE), EP 2, and TP 2 with EP 2 x ETP 1, in one pair of spawned gloo processes."""
    ids = _batch(62)
    results = spawn_workers(_parallel_worker, 2, ids)
    for i, (name, tp, ep, etp) in enumerate(PARALLEL_CASES):
        expected = hf_logits(name, ids)
        for rank in range(2):
            diff = (results[rank][i] - expected).abs().max()
            assert diff < ATOL, (name, tp, ep, etp, rank, diff.item())
