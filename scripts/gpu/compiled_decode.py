"""The compiled decode path (`generation: compiled`) on a GPU, each check in this one process:

1. an in-place weight update reaches the compiled step's CUDA graphs: the small preset in fp32, each sampled
   token's logprob against a teacher-forced pass before and after the update (both within fp32 rounding when the
   graphs read the new weights), the same seed sampling the same tokens again, and other tokens after;
2. the 1b preset in bf16 on a GRPO step's batch (16 prompts of 12-39 tokens x 8 samples x 512 new tokens), three
   calls with the engine's decode attention (`grouped_decode_attention`) and three with transformers' sdpa
   attention, tokens a second for each (the first call of each compiles).

    PYTHONPATH=libs:. python3 scripts/gpu/compiled_decode.py
"""

from __future__ import annotations

import time

import torch

from rlserve.models import resolve_model
from rlserve.rollout.hf_engine import TransformersEngine
from rlserve.rollout.interfaces import EngineConfig, GeneratedSample, SamplingSpec


def engine(preset: str, dtype: str) -> TransformersEngine:
    return TransformersEngine(EngineConfig(model_path=resolve_model(f"preset:{preset}"), dtype=dtype, device="cuda",
                                           generation="compiled", max_num_seqs=128, max_model_len=1024))


@torch.inference_mode()
def worst_logprob_error(eng: TransformersEngine, prompts: list[list[int]], out: list[list[GeneratedSample]]) -> float:
    worst = 0.0
    for prompt, samples in zip(prompts, out):
        for s in samples:
            ids = torch.tensor([prompt + s.token_ids], device="cuda")
            logp = eng.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            want = logp.gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()
            worst = max(worst, (want - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def update_check() -> None:
    eng = engine("small", "float32")
    prompts = [[5 + i] * (3 + i) for i in range(4)]
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=40, seed=1)
    before = eng.generate(prompts, 4, sampling)
    again = eng.generate(prompts, 4, sampling)
    error_before = worst_logprob_error(eng, prompts, before)
    g = torch.Generator(device="cuda").manual_seed(0)
    eng.load_weights([(name, p.detach() + 0.05 * torch.randn(p.shape, device="cuda", generator=g))
                      for name, p in eng.model.named_parameters()])
    after = eng.generate(prompts, 4, sampling)
    ids = [[s.token_ids for s in ss] for ss in before]
    print(f"in-place update, small fp32: logprob error before {error_before:.2e}, after "
          f"{worst_logprob_error(eng, prompts, after):.2e}; same seed, same tokens {ids == [[s.token_ids for s in ss] for ss in again]}; "
          f"tokens changed {ids != [[s.token_ids for s in ss] for ss in after]}", flush=True)


def speed() -> None:
    eng = engine("1b", "bfloat16")
    prompts = [[5 + i % 50] * (12 + i % 28) for i in range(16)]
    for attention in (eng.model.config._attn_implementation, "sdpa"):
        eng.model.set_attn_implementation(attention)
        for call in range(3):
            t0 = time.perf_counter()
            out = eng.generate(prompts, 8, SamplingSpec(temperature=1.0, max_new_tokens=512))
            torch.cuda.synchronize()
            seconds, tokens = time.perf_counter() - t0, sum(len(s.token_ids) for ss in out for s in ss)
            print(f"1b bf16, attention {attention}, call {call}: {seconds:.2f} s, {tokens} tokens, "
                  f"{tokens / seconds:,.0f} tokens/s", flush=True)
    print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    update_check()
    speed()
