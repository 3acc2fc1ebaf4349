"""Model shapes that the project generates itself (no downloads at run time).

`tiny` is the demo/test model (`make demo` learns with it on 2 cores; 32-wide
heads because vLLM's CPU attention supports head sizes that are multiples of
32 from 32 up, and untied embeddings because vLLM's CPU in-place weight
reload used to leave a tied output layer stale), `small` (29M parameters) and
`medium` (101M, weight-transfer benchmarks) are for CPU benchmarks, `1b`
for GPU benchmarks, `1b-152k` is `1b` with a Qwen-sized vocabulary (151,936
entries, 0.31B parameters in the output layer alone) where the logprob and
entropy memory dominates, `tiny-chat` is `tiny` with a byte-level BPE
tokenizer, a chat template and two EOS ids (what a real chat model brings),
`moe-tiny` exercises the Mixtral-shaped MoE path of the Megatron backend, and
`qwen3-moe-tiny` is a Qwen3-MoE (q/k norms, 4 experts, top-2 renormalised) for
end-to-end MoE runs through either backend.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    name: str
    architecture: str  # "llama", "mixtral" or "qwen3_moe"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Vocab padded above the tokenizer's size (unused rows), to give large
    # presets a realistic output-layer cost. 0 means "the tokenizer's size".
    padded_vocab_size: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    rope_theta: float = 10000.0
    # "char" (one token per symbol of the built-in tasks) or "bpe-chat" (byte-level BPE with a
    # chat template and two EOS ids, see rlserve.models.bpe).
    tokenizer: str = "char"


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("tiny", "llama", 192, 2, 6, 2, 768, 256, False),
        ModelPreset("small", "llama", 512, 8, 8, 4, 1536, 512, False, padded_vocab_size=4096),
        ModelPreset("medium", "llama", 768, 14, 12, 4, 2048, 512, False, padded_vocab_size=8192),
        ModelPreset("1b", "llama", 2048, 16, 16, 8, 5632, 4096, False, padded_vocab_size=32000),
        ModelPreset("1b-152k", "llama", 2048, 16, 16, 8, 5632, 32768, False, padded_vocab_size=151936),
        ModelPreset("tiny-chat", "llama", 192, 2, 6, 2, 768, 256, False, tokenizer="bpe-chat"),
        ModelPreset("moe-tiny", "mixtral", 128, 2, 4, 2, 256, 256, False, num_experts=4, experts_per_token=2),
        ModelPreset("qwen3-moe-tiny", "qwen3_moe", 128, 2, 4, 2, 128, 256, False, num_experts=4,
                    experts_per_token=2),
    )
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}") from None
