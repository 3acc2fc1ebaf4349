"""Write a generated Llama/Mixtral-shaped model as a Hugging Face folder.

The folder is what every engine loads: transformers (learner, reference),
vLLM (rollout) and the HF->Megatron converter. Weights are deterministic in
the seed so two machines that run `rlserve make-model` get the same model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, MixtralConfig, PretrainedConfig

from rlserve.models.bpe import save_bpe_tokenizer
from rlserve.models.presets import ModelPreset
from rlserve.models.tokenizer import SpecialIds, save_tokenizer

# Tokenizer kinds of the presets: each writes its files into the model folder and returns its ids.
TOKENIZERS: dict[str, Callable[[Path, int], SpecialIds]] = {"char": save_tokenizer, "bpe-chat": save_bpe_tokenizer}


def hf_config(preset: ModelPreset, ids: SpecialIds) -> PretrainedConfig:
    common = dict(
        vocab_size=max(ids.vocab_size, preset.padded_vocab_size),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.ffn_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=preset.rope_theta,
        tie_word_embeddings=preset.tie_word_embeddings,
        bos_token_id=ids.bos,
        eos_token_id=ids.eos[0] if len(ids.eos) == 1 else ids.eos,
        pad_token_id=ids.pad,
        torch_dtype="float32",
    )
    if preset.architecture == "llama":
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if preset.architecture == "mixtral":
        return MixtralConfig(
            **common, num_local_experts=preset.num_experts, num_experts_per_tok=preset.experts_per_token
        )
    raise ValueError(f"unknown architecture {preset.architecture!r}; valid: llama, mixtral")


def make_model(preset: ModelPreset, out_dir: Path, seed: int = 0) -> Path:
    """Create the model with seeded random init and save it (safetensors) with its tokenizer."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = TOKENIZERS[preset.tokenizer](out_dir, preset.max_position_embeddings)
    config = hf_config(preset, ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                  "pad_token_id": config.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out_dir / "rlserve_preset.json").write_text(json.dumps({"preset": preset.name, "seed": seed}) + "\n")
    return out_dir
