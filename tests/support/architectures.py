"""Tiny random models of the architectures people fine-tune, built from transformers config classes.

One entry per architecture (or variant that takes its own code path): tied and
untied Llama 3 (several EOS ids, llama3 RoPE scaling), Qwen2 (q/k/v biases),
Qwen3 (q/k norms, heads * head_dim != hidden), Qwen3-MoE and Mixtral
(transformers 5 fuses their experts in memory; the checkpoint keeps them one
by one), Mistral with and without a sliding window, Gemma2 (final-logit and
attention soft-capping, sandwich norms, scaled embeddings), Gemma3 text (q/k
norms, local/global RoPE) and Phi3 (fused qkv_proj and gate_up_proj).

Sizes keep every engine on its fast path: head_dim 32 (vLLM's CPU attention
wants multiples of 32), hidden and expert FFN widths multiples of 32 (vLLM's
CPU MoE kernel). Soft-capping values are small, and a sliding window of 8
shorter than the test sequences, so that skipping either shows up as a large
logprob error. Norm weights and biases are randomised (HF initialises them to
constants, which would hide a layout mistake).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import transformers

from rlserve.models.tokenizer import BOS, EOS, PAD, save_tokenizer, token_id, vocab_size

SMALL = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6)
WINDOW = 8  # shorter than the test sequences: a skipped window changes the numbers

ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-tied": ("LlamaConfig", dict(
        tie_word_embeddings=True, eos_token_id=[token_id(EOS), token_id("!")], max_position_embeddings=16384,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=8, tie_word_embeddings=False)),  # 8 * 32 != hidden
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True, tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False)),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(final_logit_softcapping=2.0, attn_logit_softcapping=1.0, query_pre_attn_scalar=32,
                                    sliding_window=WINDOW, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(query_pre_attn_scalar=32, sliding_window=WINDOW, final_logit_softcapping=2.0,
                                        layer_types=["sliding_attention", "full_attention"],
                                        tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, pad_token_id=token_id(PAD))),
}


def hf_config(name: str):
    cls_name, extra = ARCHITECTURES[name]
    kwargs = dict(SMALL, vocab_size=vocab_size(), bos_token_id=token_id(BOS), eos_token_id=token_id(EOS),
                  pad_token_id=token_id(PAD), dtype="float32")
    kwargs.update(extra)
    return getattr(transformers, cls_name)(**kwargs)


def _randomise_constants(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and biases start as constants in HF; make their layout visible."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def make_architecture(name: str, out_dir: Path, seed: int = 0) -> Path:
    """A random tiny model of `name` saved as an HF folder (safetensors, tokenizer, generation config)."""
    config = hf_config(name)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_constants(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(out_dir, model_max_length=config.max_position_embeddings)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                  "pad_token_id": config.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir


@functools.cache
def architecture_dir(name: str, root: str) -> Path:
    """The model folder for `name` under `root`, made once per process."""
    path = Path(root) / name
    return path if (path / "config.json").is_file() else make_architecture(name, path)
