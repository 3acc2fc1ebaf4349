"""Generation on one GPU, RL-shaped: the transformers engine's paths side by side, in one process.

The shape is a GRPO step's: `--prompts` prompts of varied length, `--n` samples each (sharing their
prompt), up to `--max-new-tokens` new tokens (random weights rarely stop early). Each mode generates the
same batch after a warm-up round; the table gives tokens a second, the step's seconds and, for every mode,
how far its sampled logprobs are from a teacher-forced forward pass of the same tokens (the
importance-sampling correction needs them exact):

    engine   rlserve's TransformersEngine.generate (transformers `generate`, a dynamic cache)
    cb       transformers' continuous batching (`generate_batch`: a paged KV cache, CUDA graphs)
    static   `generate` with a static cache and a compiled decode step

    python scripts/bench/generation_gpu.py --preset 1b --dtype bfloat16    (bench-results/generation_gpu.json)

On a CPU machine it runs the same paths on a small preset (a smoke run; its speeds mean nothing).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from rlserve.dtypes import torch_dtype  # noqa: E402
from rlserve.models import generation, resolve_model  # noqa: E402
from rlserve.models.architecture import load_causal_lm  # noqa: E402
from scripts.bench.common import record, table  # noqa: E402


def prompts_of(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
            for _ in range(args.prompts)]


def teacher_forced(model, rows: list[tuple[list[int], list[int]]], device) -> list[list[float]]:
    """The model's logprob of each sampled token, prompt and sample in one forward pass per row."""
    out = []
    with torch.inference_mode():
        for prompt, sample in rows:
            ids = torch.tensor([prompt + sample], device=device)
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            out.append(logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1).tolist())
    return out


def run_engine(model, tokenizer, prompts, args, device) -> list[tuple[list[int], list[int], list[float]]]:
    eos = generation.eos_ids(model, tokenizer)
    pad = generation.pad_id(tokenizer, eos)
    rows = [p for p in prompts for _ in range(args.n)]
    input_ids, attention = generation.left_padded(rows, pad)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), do_sample=True,
                         temperature=1.0, top_p=None, top_k=0, max_new_tokens=args.max_new_tokens,
                         eos_token_id=sorted(eos), pad_token_id=pad, output_logits=True,
                         return_dict_in_generate=True, cache_implementation=args.cache)
    new = out.sequences[:, input_ids.shape[1]:]
    lps = torch.stack([s.float().log_softmax(-1).gather(-1, new[:, t:t + 1]).squeeze(-1)
                       for t, s in enumerate(out.logits)], dim=1).cpu()
    result = []
    for i, row in enumerate(rows):
        ids = new[i].tolist()
        end = next((k + 1 for k, t in enumerate(ids) if t in eos), len(ids))
        result.append((row, ids[:end], lps[i, :end].tolist()))
    return result


def run_cb(model, tokenizer, prompts, args, device) -> list[tuple[list[int], list[int], list[float]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    eos = generation.eos_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                              top_k=0, eos_token_id=sorted(eos), pad_token_id=generation.pad_id(tokenizer, eos),
                              num_return_sequences=args.n)
    cb = ContinuousBatchingConfig(return_logprobs=True, use_cuda_graph=device.type == "cuda",
                                  max_memory_percent=args.cb_memory)
    outputs = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb)
    return [(list(o.prompt_ids), list(o.generated_tokens), list(o.logprobs)) for o in outputs.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=None, help="default: 1b on a GPU, tiny on the CPU")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=12)
    parser.add_argument("--max-prompt", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--modes", default="engine,cb,static")
    parser.add_argument("--cb-memory", type=float, default=0.5, help="continuous batching's share of GPU memory")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset or ("1b" if device.type == "cuda" else "tiny")
    from transformers import AutoTokenizer

    path = resolve_model(f"preset:{preset}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_causal_lm(path, torch_dtype(args.dtype)).to(device).eval()
    prompts = prompts_of(args, model.config.vocab_size)
    rows: list[dict] = []
    for mode in args.modes.split(","):
        args.cache = "static" if mode == "static" else None
        run = run_cb if mode == "cb" else run_engine
        try:
            run(model, tokenizer, prompts[:2], argparse.Namespace(**{**vars(args), "max_new_tokens": 16}), device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = run(model, tokenizer, prompts, args, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001 - a mode this transformers cannot run is reported, not fatal
            rows.append({"mode": mode, "error": f"{type(err).__name__}: {str(err)[:200]}"})
            continue
        tokens = sum(len(s) for _, s, _ in out)
        check = out[:: max(1, len(out) // 8)]
        exact = teacher_forced(model, [(p, s) for p, s, _ in check], device)
        error = max((abs(a - b) for (_, _, lps), ref in zip(check, exact) for a, b in zip(lps, ref)), default=0.0)
        rows.append({"mode": mode, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                     "samples": len(out), "max_abs_logprob_error": error})
    base = next((r["tokens_per_s"] for r in rows if r["mode"] == "engine" and "tokens_per_s" in r), None)
    for r in rows:
        if base and "tokens_per_s" in r:
            r["vs_engine"] = r["tokens_per_s"] / base
    print(table(rows, ["mode", "seconds", "tokens", "tokens_per_s", "max_abs_logprob_error", "vs_engine", "error"]))
    print(record("generation_gpu", rows, {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "preset": preset,
        "dtype": args.dtype, "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": [args.min_prompt, args.max_prompt]}))


if __name__ == "__main__":
    main()
