"""Prompt logprobs under a LoRA adapter on vLLM's CPU build, which otherwise kills the engine.

vLLM applies the unembedding's LoRA (`LogitsProcessorWithLoRA`) with one adapter index per sampled
sequence (`sampler_indices`), also when it computes prompt logprobs, where the rows are the prompt's
tokens (vllm-project/vllm#29955, #51594). On the CPU build the shapes then disagree inside an einsum and
the engine core dies for every caller (a Tinker `sample` with `include_prompt_logprobs` and two samples:
"subscript b has size 2 ... previously seen size 5"); the GPU build silently drops the delta.

rlserve's adapters never adapt the unembedding (`learner/lora.py` targets the decoder layers' linears),
so the unembedding's LoRA weights are zero for every adapter the engine holds and its delta is zero for
any mapping. The CPU wrapper's logits call skips the rows it cannot map, which is exact for these
adapters; the rows it can map (one a sequence, sampling) keep vLLM's own path.
"""

from __future__ import annotations


def install() -> None:
    """Patch vLLM's CPU punica wrapper in this worker process (idempotent)."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    original = PunicaWrapperCPU.add_lora_logits
    if getattr(original, "_rlserve", False):
        return

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs):  # noqa: ANN001 - vLLM's
        if x.reshape(-1, x.shape[-1]).size(0) != self.sampler_indices.size(0):
            return None  # prompt rows: the unembedding's LoRA delta of rlserve's adapters is zero
        return original(self, y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs)

    add_lora_logits._rlserve = True
    PunicaWrapperCPU.add_lora_logits = add_lora_logits
