"""Which model/backend combinations are refused before a run starts, and with what message."""

from __future__ import annotations

import pytest
from transformers import Gemma2Config, MistralConfig, MixtralConfig, Phi3Config, Qwen3MoeConfig

from rlserve.config import parse_spec
from rlserve.learner.megatron.support import unsupported_reasons
from rlserve.learner.registry import UnsupportedModel, check_model

SMALL = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=62, max_position_embeddings=4096)


def spec(megatron: bool = False, tp: int = 1, seq: int = 128, **megatron_cfg):
    policy = {"max_total_sequence_length": seq, "generation": {"max_new_tokens": 8}}
    if megatron:
        policy["megatron_cfg"] = {"enabled": True, **megatron_cfg}
    else:
        policy["dtensor_cfg"] = {"tensor_parallel_size": tp}
    return parse_spec({"policy": policy, "cluster": {"num_workers": tp}})


def test_megatron_refuses_gemma_naming_the_alternative():
    with pytest.raises(UnsupportedModel) as err:
        check_model(spec(megatron=True), Gemma2Config(**SMALL))
    assert err.value.field == "policy.megatron_cfg"
    assert "soft-capping" in err.value.reason and "policy.dtensor_cfg" in err.value.reason
    check_model(spec(), Gemma2Config(**SMALL))  # the dtensor backend trains it


def test_sliding_window_is_refused_only_where_it_binds():
    windowed = MistralConfig(**SMALL, sliding_window=256)
    with pytest.raises(UnsupportedModel, match="sliding_window 256"):
        check_model(spec(megatron=True, seq=512), windowed)
    check_model(spec(megatron=True, seq=256), windowed)  # no sequence is longer than the window


def test_moe_routing_and_layout_checks():
    assert not unsupported_reasons(Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=1, norm_topk_prob=False))
    assert unsupported_reasons(MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=1))
    mixed = Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0])
    assert any("dense layers" in r for r in unsupported_reasons(mixed))


def test_dtensor_tp_beyond_kv_heads_is_refused_unless_attention_stays_whole():
    with pytest.raises(UnsupportedModel) as err:
        check_model(spec(tp=4), MistralConfig(**SMALL))
    assert err.value.field == "policy.dtensor_cfg.tensor_parallel_size" and "megatron_cfg" in err.value.reason
    check_model(spec(tp=2), MistralConfig(**SMALL))
    check_model(spec(tp=4), Phi3Config(**SMALL))  # fused qkv_proj: attention runs whole on every TP rank


def test_megatron_lora_targets_dense_layers_and_the_local_spec():
    def lora(**peft):
        return spec(megatron=True, peft={"enabled": True, **peft})

    check_model(lora(), MistralConfig(**SMALL))
    check_model(lora(target_modules=["q_proj", "v_proj"]), MistralConfig(**SMALL))  # part of fused linear_qkv
    check_model(lora(target_modules=["qkv_proj", "o_proj"]), Phi3Config(**SMALL))  # HF fuses them too
    with pytest.raises(UnsupportedModel) as err:
        check_model(lora(target_modules=["q_proj", "gate_up_proj"]), MistralConfig(**SMALL))
    assert err.value.field == "policy.megatron_cfg.peft.target_modules" and "'gate_up_proj'" in err.value.reason
    with pytest.raises(UnsupportedModel, match="excludes every target"):
        check_model(lora(exclude_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_modules=["o_proj"]),
                    MistralConfig(**SMALL))
    moe = MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(UnsupportedModel, match="'w1' is an MoE expert layer"):
        check_model(lora(target_modules=["w1"]), moe)
    check_model(lora(), moe)  # every linear layer of an MoE model's decoder layers: attention
    with pytest.raises(UnsupportedModel) as err:
        check_model(spec(megatron=True, transformer_impl="transformer_engine", peft={"enabled": True}),
                    MistralConfig(**SMALL))
    assert err.value.field == "policy.megatron_cfg.transformer_impl"
