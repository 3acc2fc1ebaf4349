"""RL-shaped learner benchmark on one GPU (no Ray, no vLLM): GRPO steps on sequences of long-tailed
lengths, padded vs packed, both backends, against a plain transformers + FSDP2 loop on the same
real tokens, and against the same backend on fixed-length rows at equal tokens per micro-batch.

The batch (`rl_lengths`, documented there) is shaped like a GRPO rollout: `--seqs` sequences of a
`--prompt`-token prompt plus a completion whose length is log-normal (median
`--median-completion`, 600 tokens, sigma 0.8: a long tail of a few near the cap), clipped to
16 .. `--max-len` - prompt. GRPO loss with
random advantages, generator logprobs (importance-sampling correction on) and reference logprobs
(KL penalty 0.01); one optimizer update per step over the whole batch.

Runs (`--runs`, each `learner:layout`):
  - plain:padded    AutoModelForCausalLM + FSDP2 (bf16 mixed precision) + AdamW, micro-batches of
                    `--micro-batch` rows, attention mask, cross-entropy on completion tokens only;
  - dtensor|megatron:padded   the backend, micro-batches of `--micro-batch` rows (right padding);
  - dtensor|megatron:packed   sequence packing into bins of `--pack-tokens` (the default algorithm,
                              "balanced"; `packed-ffd`: plain first-fit decreasing);
  - dtensor|megatron:fixed    every row `--fixed-seq` tokens (prompt `--prompt`), as many rows as
                              make the batch's real token count, `--pack-tokens` tokens per micro-batch.
  - dtensor-lora:LAYOUT       the dtensor backend training LoRA adapters of rank `--lora-rank` (32) on every
                              linear layer of attention and MLP (the base frozen in bf16); rows report step
                              time and peak memory against dtensor:LAYOUT (full fine-tuning, no checkpointing).
  - LEARNER+acF:LAYOUT        a dtensor learner with activation checkpointing of the fraction F of its decoder
                              layers (`policy.dtensor_cfg.activation_checkpointing_fraction`; each keeps only
                              its input), e.g. dtensor-lora+ac0.125:packed; `--activation-checkpointing` turns it
                              on for every dtensor run (all layers) instead.

Reported per run: real (non-pad) tokens/s, model TFLOP/s and MFU on real tokens (6 x parameters
without the input embedding per token, plus 12 x layers x hidden x length per token of each
sequence for attention: the PaLM formula per sequence, no causal discount) against a bf16
8192^3 matmul measured in the same run, the padding overhead, and peak GPU memory (over the
whole run, and over the training steps alone). With several runs, each runs in a fresh process.
`--logprob-memory` also measures the peak memory of forward + backward of the chunked logprobs
against the plain function, at the preset's vocabulary.

    python scripts/bench/learner_rl_gpu.py --preset 1b --out rl.json
    # LoRA against full on the 1b GRPO step's batch, LoRA with 0, 1/16, 1/8 and 1/4 of the layers checkpointed:
    python scripts/bench/learner_rl_gpu.py --preset 1b --seqs 128 --prompt 12 --max-len 524 --median-completion 2000 \
        --micro-batch 16 --pack-tokens 16384 --lora-rank 32 --runs dtensor:packed dtensor-lora:packed \
        dtensor-lora+ac0.0625:packed dtensor-lora+ac0.125:packed dtensor-lora+ac0.25:packed
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

import torch  # noqa: E402

from rlserve.training.batch import TrainBatch  # noqa: E402
from scripts.bench.learner_gpu import init_one_gpu, matmul_tflops, model_folder, sync_time  # noqa: E402

SIGMA = 0.8


def rl_lengths(n: int, prompt: int, max_len: int, median: int, seed: int) -> list[int]:
    """Total lengths: prompt + completion, completion ~ LogNormal(ln median, 0.8) clipped to 16..max-prompt."""
    g = torch.Generator().manual_seed(seed)
    comp = torch.exp(math.log(median) + SIGMA * torch.randn(n, generator=g))
    return [prompt + int(c) for c in comp.clamp(16, max_len - prompt)]


def grpo_batch(lengths: list[int], prompt: int, vocab: int, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]
    gen = [(-2 * torch.rand(n - prompt, generator=g)).tolist() for n in lengths]
    ref = [(-2 * torch.rand(n - prompt, generator=g)).tolist() for n in lengths]
    advantages = torch.randn(len(lengths), generator=g).tolist()
    return TrainBatch.from_sequences(seqs, [prompt] * len(lengths), advantages, gen, ref)


def model_flops(path: Path, lengths: list[int]) -> float:
    """Model FLOPs of one training step over sequences of `lengths` (module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return sum(6 * params * n + 12 * config.num_hidden_layers * config.hidden_size * n * n for n in lengths)


def learner_of(name: str, activation_checkpointing: bool) -> tuple[str, float | None]:
    """(backend, fraction of layers checkpointed or None) of a run's learner part: "dtensor-lora+ac0.125" ->
    ("dtensor-lora", 0.125); `activation_checkpointing` (the flag): every layer of a dtensor run."""
    backend, _, ac = name.partition("+ac")
    if ac:
        return backend, float(ac)
    return backend, 1.0 if activation_checkpointing and backend.startswith("dtensor") else None


def spec_for(name: str, layout: str, micro_batch: int, pack_tokens: int, max_len: int, lora_rank: int,
             activation_checkpointing: bool):
    from rlserve.config import parse_spec

    backend, ac_fraction = learner_of(name, activation_checkpointing)

    packing = {"enabled": layout.startswith("packed"), "train_mb_tokens": pack_tokens}
    if layout == "packed-ffd":
        packing["algorithm"] = "first_fit_decreasing"
    policy = {"precision": "bfloat16", "max_total_sequence_length": max_len, "train_micro_batch_size": micro_batch,
              "generation": {"max_new_tokens": 16}, "max_grad_norm": 1.0,
              "sequence_packing": packing}
    if backend == "megatron":
        policy["megatron_cfg"] = {"enabled": True}
    if backend.startswith("dtensor"):
        policy["dtensor_cfg"] = {"activation_checkpointing": ac_fraction is not None,
                                 "activation_checkpointing_fraction": ac_fraction or 1.0}
    if backend == "dtensor-lora":
        policy["dtensor_cfg"]["lora_cfg"] = {"enabled": True, "dim": lora_rank}
    return parse_spec({"policy": policy, "cluster": {"device": "cuda"},
                       "loss_fn": {"reference_policy_kl_penalty": 0.01, "use_importance_sampling_correction": True}})


def backend_step(name: str, path: Path, batch: TrainBatch, layout: str, micro_batch: int, pack_tokens: int,
                 max_len: int, lora_rank: int, activation_checkpointing: bool) -> tuple[Callable[[], None], str, dict]:
    from rlserve.learner import make_backend
    from rlserve.training.objective import StepObjective

    spec = spec_for(name, layout, micro_batch, pack_tokens, max_len, lora_rank, activation_checkpointing)
    backend = make_backend(spec, path, torch.device("cuda", 0))
    plan = StepObjective(spec, batch, "grpo", 1, 0, backend.pad_id).plans
    shape = {"micro_batches": sum(len(p) for p in plan),
             "computed_tokens": sum(mb.input_ids.numel() for p in plan for mb in p),
             "largest_micro_batch_tokens": max(mb.input_ids.numel() for p in plan for mb in p)}
    return (lambda: backend.train_step(batch, "grpo")), backend.info().parallel_layout, shape


def plain_step(path: Path, batch: TrainBatch, micro_batch: int) -> tuple[Callable[[], None], str, dict]:
    """transformers + FSDP2 + AdamW, padded micro-batches, CE over completion tokens (a reference
    for the same real tokens: no importance weights or KL, which cost little)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    chunks = []
    for k in range(0, batch.num_seqs, micro_batch):
        seqs = [batch.sequence(i) for i in range(k, min(k + micro_batch, batch.num_seqs))]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for row, (s, i) in enumerate(zip(seqs, range(k, k + len(seqs)))):
            ids[row, :len(s)], mask[row, :len(s)] = s, 1
            p = int(batch.prompt_lens[i])
            labels[row, p:len(s)] = s[p:]
        chunks.append((ids.cuda(), mask.cuda(), labels.cuda()))

    def step() -> None:
        for ids, mask, labels in chunks:
            (model(input_ids=ids, attention_mask=mask, labels=labels).loss / len(chunks)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    sizes = [ids.numel() for ids, _, _ in chunks]
    return step, "fsdp2 1 rank, transformers sdpa + mask", {
        "micro_batches": len(chunks), "computed_tokens": sum(sizes), "largest_micro_batch_tokens": max(sizes)}


def logprob_memory(vocab: int, hidden: int, rows: int) -> dict:
    """Peak GiB of forward + backward of log p(target) over `rows` rows: chunked vs plain."""
    from rlserve.training.forward import gather_logprobs

    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda")

    def plain_chunked() -> None:  # the previous implementation: chunked forward, autograd keeps every chunk
        rows_per = max(256, 2**30 // (4 * vocab))
        out = []
        for k in range(0, rows, rows_per):
            logits = (h[k:k + rows_per] @ w.t()).float()
            out.append(logits.gather(-1, t[k:k + rows_per, None]).squeeze(-1) - torch.logsumexp(logits, -1))
        torch.cat(out).sum().backward()

    def ours() -> None:
        gather_logprobs(h, w, t, with_entropy=True)[0].sum().backward()

    result = {"vocab": vocab, "rows": rows}
    for name, fn in (("chunked_recompute", ours), ("chunked_autograd", plain_chunked)):
        h.grad = w.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seconds = sync_time(fn, steps=3, warmup=1)
        result[f"{name}_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        result[f"{name}_ms"] = seconds * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--median-completion", type=int, default=600)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--pack-tokens", type=int, default=32768)
    parser.add_argument("--fixed-seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", nargs="+", default=["plain:padded", "dtensor:padded", "dtensor:packed",
                                                      "dtensor:fixed", "megatron:padded", "megatron:packed",
                                                      "megatron:fixed"])
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="the dtensor backend's activation checkpointing, for every dtensor run")
    parser.add_argument("--lora-rank", type=int, default=32, help="the adapters' rank in dtensor-lora runs")
    parser.add_argument("--logprob-memory", type=int, default=0, help="rows for the logprob memory check (0: skip)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from transformers import AutoConfig

    init_one_gpu()
    peak = matmul_tflops()
    torch.cuda.empty_cache()
    path = model_folder(args.preset)
    config = AutoConfig.from_pretrained(path)
    lengths = rl_lengths(args.seqs, args.prompt, args.max_len, args.median_completion, args.seed)
    rl = grpo_batch(lengths, args.prompt, config.vocab_size, args.seed)
    real = sum(lengths)
    fixed_rows = -(-real // args.fixed_seq)
    fixed = grpo_batch([args.fixed_seq] * fixed_rows, args.prompt, config.vocab_size, args.seed)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "preset": args.preset,
              "seqs": args.seqs, "prompt": args.prompt, "max_len": args.max_len,
              "length_distribution": f"prompt {args.prompt} + LogNormal(ln {args.median_completion}, {SIGMA}) "
                                     f"clipped to 16..{args.max_len - args.prompt}",
              "lengths": {"mean": real / len(lengths), "max": max(lengths), "min": min(lengths), "total": real},
              "micro_batch": args.micro_batch, "pack_tokens": args.pack_tokens, "fixed_seq": args.fixed_seq,
              "steps": args.steps, "activation_checkpointing": args.activation_checkpointing,
              "lora_rank": args.lora_rank,
              "matmul_bf16_tflops": peak, "rows": []}
    for run in args.runs:
        name, layout = run.split(":")
        batch = fixed if layout == "fixed" else rl
        row = run_isolated(run, args) if len(args.runs) > 1 else measure(run, name, layout, batch, path, args, peak)
        result["rows"].append(row)
        print(result["rows"][-1], flush=True)
        add_ratios(result["rows"])
        write(result, args.out)  # after every run: a later one may run out of memory or time
    if args.logprob_memory:
        result["logprob_memory"] = logprob_memory(config.vocab_size, config.hidden_size, args.logprob_memory)
        print(result["logprob_memory"], flush=True)
        write(result, args.out)
    print(json.dumps(result, indent=1))


def run_isolated(run: str, args) -> dict:
    """`run` measured in a fresh process, so that no run's memory or state leaks into the next."""
    out = Path(tempfile.mkdtemp()) / "row.json"
    cmd = [sys.executable, __file__, "--runs", run, "--out", str(out)]
    for key in ("preset", "seqs", "prompt", "max_len", "median_completion", "micro_batch", "pack_tokens", "fixed_seq",
                "steps", "seed", "lora_rank"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.activation_checkpointing:
        cmd.append("--activation-checkpointing")
    code = subprocess.run(cmd, check=False).returncode
    return json.loads(out.read_text())["rows"][0] if out.is_file() else {"run": run, "error": f"exit code {code}"}


def measure(run: str, name: str, layout: str, batch: TrainBatch, path: Path, args, peak: float) -> dict:
    """One run's row: timings, throughput on real tokens, MFU, padding and peak memory (or its error)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    row = {"run": run, "start_mem_gib": torch.cuda.memory_allocated() / 2**30}
    try:
        if name == "plain":
            step, desc, shape = plain_step(path, batch, args.micro_batch)
        else:
            micro = args.pack_tokens // args.fixed_seq if layout == "fixed" else args.micro_batch
            step, desc, shape = backend_step(name, path, batch, layout, micro, args.pack_tokens, args.max_len,
                                             args.lora_rank, args.activation_checkpointing)
        build_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        seconds = sync_time(step, args.steps)
        del step
    except Exception as err:  # noqa: BLE001 - report and go on with the other runs
        row.update({"error": f"{type(err).__name__}: {err}"[:600],
                    "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30})
        return row
    seq_lens = [int(n) for n in batch.seq_lens]
    tokens = sum(seq_lens)
    flops = model_flops(path, seq_lens)
    row.update({"layout": desc, "step_s": seconds, "real_tokens": tokens, **shape,
                "padding_overhead": shape["computed_tokens"] / tokens - 1,
                "real_tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12,
                "mfu_vs_measured_matmul": flops / seconds / 1e12 / peak,
                "peak_mem_gib": max(build_peak, torch.cuda.max_memory_allocated()) / 2**30,
                "peak_step_mem_gib": torch.cuda.max_memory_allocated() / 2**30})
    return row


def add_ratios(rows: list[dict]) -> None:
    """Real tokens/s against the same learner padded and on fixed-length rows, and against plain; a
    LoRA run's step time and peak memory against full fine-tuning (no checkpointing) in the same layout."""
    by_run = {r["run"]: r for r in rows if "real_tokens_per_s" in r}
    for r in by_run.values():
        name, layout = r["run"].split(":")
        backend = name.partition("+ac")[0]
        full = by_run.get(f"{backend.removesuffix('-lora')}:{layout}")
        if backend.endswith("-lora") and full is not None:
            r["step_time_vs_full"] = r["step_s"] / full["step_s"]
            r["peak_mem_vs_full"] = r["peak_mem_gib"] / full["peak_mem_gib"]
        for ref_run, key in ((f"{name}:padded", "vs_padded"), (f"{name}:fixed", "vs_fixed"),
                             ("plain:padded", "vs_plain")):
            if ref_run in by_run and ref_run != r["run"]:
                r[key] = r["real_tokens_per_s"] / by_run[ref_run]["real_tokens_per_s"]


def write(result: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
