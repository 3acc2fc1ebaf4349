"""Learner benchmark on one GPU (no Ray, no vLLM): tokens/s and MFU of the learner backends vs a
plain transformers + FSDP2 training loop, on the same batch, in one run.

  - matmul:   a bf16 8192^3 matmul, the ceiling MFU is measured against (same run, same GPU);
  - plain:    AutoModelForCausalLM + FSDP2 (bf16 mixed precision) + AdamW, loss = CE over all tokens,
              gradients accumulated over the same micro-batches as the backends, never
              synchronised with the host (the CPU queues steps ahead of the GPU);
  - plain+sync: the same loop reading its loss every step, as a loop that logs metrics must;
  - dtensor:  rlserve's DTensor/FSDP2 backend, SFT loss over all tokens (the same work);
  - megatron: rlserve's Megatron-Core backend (local spec unless Transformer Engine imports).

Each backend also exports its weights once as bf16 into host-memory buckets, the stream the
learner worker puts into the object store; the run measures the copy bandwidths that bound it
(device to device, device to pageable and to pinned host memory).

Model FLOPs per trained token: 6 * (parameters without the input embedding) + 12 * layers *
hidden * sequence (attention scores and values, no causal discount), as in the PaLM MFU formula.

    python scripts/bench/learner_gpu.py --preset 1b --seq 2048 --batch 8 --steps 5 --out results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

import torch  # noqa: E402

from rlserve.learner.interfaces import LearnerBackend  # noqa: E402


def sync_time(fn, steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def init_one_gpu() -> None:
    """GPU 0 and a world-size-1 process group (the backends expect one), with no TCP listener."""
    from rlserve.training.distributed import init_process_group

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.cuda.set_device(0)
    init_process_group(0, 1, f"file://{tempfile.mktemp()}", torch.device("cuda", 0))


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = sync_time(lambda: a @ b, steps=10, warmup=3)
    return 2 * n**3 / seconds / 1e12


def model_folder(preset: str) -> Path:
    from rlserve.models.factory import make_model
    from rlserve.models.presets import get_preset

    out = Path(tempfile.gettempdir()) / f"rlserve-bench-{preset}"
    if not (out / "rlserve_preset.json").is_file():
        torch.set_default_device("cuda")  # random init on the GPU: seconds instead of minutes
        make_model(get_preset(preset), out, seed=0)
        torch.set_default_device("cpu")
    return out


def flops_per_token(path: Path, seq: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6 * params + 12 * config.num_hidden_layers * config.hidden_size * seq


def batch_tokens(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(4, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def plain_step(path: Path, ids: torch.Tensor, read_loss: bool, micro_batch: int) -> Callable[[], None]:
    """One step of the reference loop, accumulating gradients over micro-batches of `micro_batch`
    rows as the backends do. With `read_loss` it reads the loss every step, as any loop that logs
    per-step metrics must (the backends return metrics every step, so they sync too)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    chunks = ids.cuda().split(micro_batch)

    def step() -> None:
        for chunk in chunks:
            loss = model(input_ids=chunk, labels=chunk).loss / len(chunks)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if read_loss:
            loss.item()

    return step


def backend_step(name: str, path: Path, ids: torch.Tensor, micro_batch: int
                 ) -> tuple[Callable[[], None], LearnerBackend]:
    """One SFT step of an rlserve backend over every token of `ids` but the first, and the backend."""
    from rlserve.config import parse_spec
    from rlserve.learner import make_backend
    from rlserve.training.batch import TrainBatch

    policy = {"precision": "bfloat16", "max_total_sequence_length": ids.shape[1],
              "train_micro_batch_size": micro_batch, "generation": {"max_new_tokens": 16}, "max_grad_norm": 1.0}
    if name == "megatron":
        policy["megatron_cfg"] = {"enabled": True}
    backend = make_backend(parse_spec({"policy": policy, "cluster": {"device": "cuda"}}), path,
                           torch.device("cuda", 0))
    batch = TrainBatch.from_sequences(ids.tolist(), [1] * ids.shape[0])
    return (lambda: backend.train_step(batch, "sft", 1e-5)), backend


def copy_bandwidths(gib: float = 2.0) -> dict[str, float]:
    """GB/s of the copies a weight export can use: device to device, device to pageable host
    memory (what `to_host` does) and device to pinned host memory."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    pinned = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    seconds = {
        "d2d": sync_time(lambda: dst.copy_(src), steps=5),
        "d2h_pageable": sync_time(lambda: src.to("cpu"), steps=3, warmup=1),
        "d2h_pinned": sync_time(lambda: pinned.copy_(src, non_blocking=True), steps=3, warmup=1),
    }
    return {f"{k}_gb_per_s": src.numel() / s / 1e9 for k, s in seconds.items()}


def export_seconds(backend: LearnerBackend, bucket_mb: int = 512) -> tuple[float, int]:
    """One bf16 weight export into host-memory buckets, as the learner worker streams it."""
    from rlserve.weights.buckets import BucketWriter

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    writer = BucketWriter(bucket_mb * 2**20, lambda bucket: None)  # the object-store put is not timed
    for name, tensor in backend.export_weights(torch.bfloat16):
        writer.add(name, tensor)
    writer.flush()
    return time.perf_counter() - t0, writer.num_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["plain", "plain+sync", "dtensor", "megatron"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    init_one_gpu()
    peak = matmul_tflops()
    copies = copy_bandwidths()
    path = model_folder(args.preset)
    per_token = flops_per_token(path, args.seq)
    from transformers import AutoConfig

    ids = batch_tokens(args.batch, args.seq, AutoConfig.from_pretrained(path).vocab_size)
    tokens = args.batch * args.seq
    rows = []
    for name in args.backends:
        torch.cuda.reset_peak_memory_stats()
        try:
            export = {}
            if name.startswith("plain"):
                step = plain_step(path, ids, read_loss=name == "plain+sync", micro_batch=args.micro_batch)
                layout = "fsdp2 1 rank" + (", loss read every step" if name == "plain+sync" else ", never synced")
                seconds = sync_time(step, args.steps)
            else:
                step, backend = backend_step(name, path, ids, args.micro_batch)
                layout = backend.info().parallel_layout
                seconds = sync_time(step, args.steps)
                export_s, export_bytes = min(export_seconds(backend) for _ in range(2))
                export = {"export_gb": export_bytes / 1e9, "export_s": export_s,
                          "export_gb_per_s": export_bytes / export_s / 1e9}
                del backend
            del step
        except Exception as err:  # noqa: BLE001 - report and go on with the other backends
            rows.append({"backend": name, "error": f"{type(err).__name__}: {err}"[:400]})
            print(rows[-1], flush=True)
            continue
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        tps = tokens / seconds
        rows.append({"backend": name, "layout": layout, "step_s": seconds, "tokens_per_s": tps,
                     "tflops": tps * per_token / 1e12, "mfu_vs_measured_matmul": tps * per_token / 1e12 / peak,
                     "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, **export})
        print(rows[-1], flush=True)
    plain = next((r for r in rows if r["backend"] == "plain" and "tokens_per_s" in r), None)
    for r in rows:
        if plain and "tokens_per_s" in r:
            r["vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "preset": args.preset,
              "seq": args.seq, "batch": args.batch, "micro_batch": args.micro_batch,
              "matmul_bf16_tflops": peak, **copies, "flops_per_token": per_token, "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
