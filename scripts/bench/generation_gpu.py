"""Generation on one GPU, RL-shaped: the transformers engine's paths and transformers' own, side by side.

The shape is a GRPO step's: `--prompts` prompts of varied length, `--n` samples each (sharing their
prompt), up to `--max-new-tokens` new tokens (random weights rarely stop early). Every mode generates the
same batch, in one process, one mode after another: a first call (which pays for any CUDA-graph capture,
compilation or cache allocation: `first_s`), then `--repeats` timed calls; the table gives tokens a second
and the median call's seconds and, for every mode, how far its sampled logprobs are from a teacher-forced
forward pass of the same tokens (the importance-sampling correction needs them exact), and `peak_gib`, the
process's peak of allocated GPU memory during the mode (the script's own copy of the model, which scores the
samples and runs the transformers-only modes, included):

    engine-generate    rlserve's TransformersEngine, generation: generate (transformers `generate`, a dynamic cache)
    engine-continuous  the engine, generation: continuous (continuous batching, a paged cache; the engine's raw
                       logprobs), sized as a rollout replica is (--max-num-seqs x --max-model-len tokens)
    engine-static      the engine, generation: static (a static cache; the decode step compiled on a GPU)
    engine-compiled    the engine, generation: compiled (rlserve's own decode loop over a static cache; forward,
                       logprob and draw in one step compiled into CUDA graphs on a GPU)
    engine-continuous-graphs   engine-continuous with CUDA graphs captured whatever the attention (transformers
                       turns them off by itself where attention needs a mask, that is without flash attention)
    cb                 transformers' `generate_batch` alone, as a user calls it (a paged cache sized from free
                       memory, CUDA graphs on, return_logprobs: the processed distribution's, here temperature 1)
    hf-static          transformers' `generate` alone, with a static cache

    python scripts/bench/generation_gpu.py --preset 1b --dtype bfloat16    (bench-results/generation_gpu.json)

On a CPU machine it runs the same paths on a small preset (a smoke run; its speeds mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from rlserve.dtypes import torch_dtype  # noqa: E402
from rlserve.models import generation, resolve_model  # noqa: E402
from rlserve.models.architecture import load_causal_lm  # noqa: E402
from rlserve.rollout.hf_engine import TransformersEngine  # noqa: E402
from rlserve.rollout.interfaces import EngineConfig, SamplingSpec  # noqa: E402
from scripts.bench.common import record, table  # noqa: E402

Samples = list[tuple[list[int], list[int], list[float]]]  # (prompt, sampled ids, their logprobs) per sample


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


class Engine:
    """The rollout engine in one generation mode, as a rollout replica builds it."""

    def __init__(self, path: Path, mode: str, args: argparse.Namespace, device: torch.device):
        mode, _, graphs = mode.partition("-")
        self.engine = TransformersEngine(EngineConfig(
            model_path=path, dtype=args.dtype, device=device.type, generation=mode,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len))
        if graphs:
            if graphs != "graphs" or self.engine._continuous is None:
                raise ValueError(f"unknown mode engine-{mode}-{graphs}: only engine-continuous-graphs")
            self.engine._continuous.cuda_graphs = True

    def __call__(self, prompts: list[list[int]], args: argparse.Namespace) -> Samples:
        groups = self.engine.generate(prompts, args.n, SamplingSpec(temperature=1.0, max_new_tokens=args.max_new_tokens))
        return [(p, s.token_ids, s.logprobs) for p, ss in zip(prompts, groups) for s in ss]

    def close(self) -> None:
        if self.engine._continuous is not None:
            self.engine._continuous.close()


def run_hf_static(model, tokenizer, prompts, args, device) -> Samples:
    eos = generation.eos_ids(model, tokenizer)
    pad = generation.pad_id(tokenizer, eos)
    rows = [p for p in prompts for _ in range(args.n)]
    input_ids, attention = generation.left_padded(rows, pad)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), do_sample=True,
                         temperature=1.0, top_p=None, top_k=0, max_new_tokens=args.max_new_tokens,
                         eos_token_id=sorted(eos), pad_token_id=pad, output_logits=True,
                         return_dict_in_generate=True, cache_implementation="static")
    new = out.sequences[:, input_ids.shape[1]:]
    lps = torch.stack([s.float().log_softmax(-1).gather(-1, new[:, t:t + 1]).squeeze(-1)
                       for t, s in enumerate(out.logits)], dim=1).cpu()
    result = []
    for i, row in enumerate(rows):
        ids = new[i].tolist()
        end = next((k + 1 for k, t in enumerate(ids) if t in eos), len(ids))
        result.append((row, ids[:end], lps[i, :end].tolist()))
    return result


def run_cb(model, tokenizer, prompts, args, device) -> Samples:
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


def timed(run, device) -> tuple[float, Samples]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def measure(mode: str, run, model, args, device) -> dict:
    first, _ = timed(run, device)
    runs = [timed(run, device) for _ in range(args.repeats)]
    seconds = statistics.median(s for s, _ in runs)
    out = runs[-1][1]
    tokens = sum(len(s) for _, s, _ in out)
    check = out[:: max(1, len(out) // 8)]
    exact = teacher_forced(model, [(p, s) for p, s, _ in check], device)
    error = max((abs(a - b) for (_, _, lps), ref in zip(check, exact) for a, b in zip(lps, ref)), default=0.0)
    row = {"mode": mode, "first_s": first, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
           "samples": len(out), "max_abs_logprob_error": error}
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=None, help="default: 1b on a GPU, tiny on the CPU")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=12)
    parser.add_argument("--max-prompt", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after the first (median)")
    parser.add_argument("--modes", default="engine-generate,engine-continuous,engine-continuous-graphs,"
                                           "engine-static,cb")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the engine's (the rollout args' default)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="the engine's (cluster_gpu_one_1b's)")
    parser.add_argument("--cb-memory", type=float, default=0.5, help="cb's share of free GPU memory")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset or ("1b" if device.type == "cuda" else "tiny")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    from transformers import AutoTokenizer

    path = resolve_model(f"preset:{preset}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    # transformers' own modes run on this model, and it scores every mode's samples teacher-forced.
    model = load_causal_lm(path, torch_dtype(args.dtype)).to(device).eval()
    prompts = prompts_of(args, model.config.vocab_size)
    rows: list[dict] = []
    for mode in args.modes.split(","):
        engine = None
        try:
            if mode.startswith("engine-"):
                engine = Engine(path, mode.removeprefix("engine-"), args, device)
                run = partial(engine, prompts, args)
            elif mode in ("cb", "hf-static"):
                run = partial(run_cb if mode == "cb" else run_hf_static, model, tokenizer, prompts, args, device)
            else:
                raise ValueError(f"unknown mode {mode!r}")
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            rows.append(measure(mode, run, model, args, device))
        except Exception as err:  # noqa: BLE001 - a mode this transformers cannot run is reported, not fatal
            rows.append({"mode": mode, "error": f"{type(err).__name__}: {str(err)[:300]}"})
        finally:
            if engine is not None:
                engine.close()
            engine = run = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(table(rows[-1:], list(rows[-1])), flush=True)
        base = next((r["tokens_per_s"] for r in rows if r["mode"] == "engine-generate" and "tokens_per_s" in r), None)
        for r in rows:
            if base and "tokens_per_s" in r:
                r["vs_engine_generate"] = r["tokens_per_s"] / base
        # Written after every mode: a run cut short keeps what it measured.
        out_path = record("generation_gpu", rows, {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "preset": preset,
            "dtype": args.dtype, "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
            "prompt_tokens": [args.min_prompt, args.max_prompt], "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len, "repeats": args.repeats,
            "transformers": __import__("transformers").__version__, "torch": torch.__version__})
    print(table(rows, ["mode", "first_s", "seconds", "tokens", "tokens_per_s", "max_abs_logprob_error",
                       "vs_engine_generate", "peak_gib", "error"]))
    print(out_path)


if __name__ == "__main__":
    main()
