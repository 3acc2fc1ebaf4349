"""Multi-GPU validation in one run (no Ray, no vLLM): the learner backends over several GPUs
against one GPU, and moving exported weights to another GPU over NCCL against host memory.

    python scripts/bench/multi_gpu.py --gpus 2 --out multi_gpu.json            # H200 x2 or more
    python scripts/bench/multi_gpu.py --device cpu --preset tiny --seq 32 ...  # dry run on gloo

Phases (each one a fresh set of processes, one per rank, file rendezvous: nothing listens
beyond this host):

  - megatron tp=1 on one GPU, then tp=2, pp=2 and dp=2 (and tp=2 x pp=2 with 4 GPUs);
  - dtensor on one GPU, then FSDP2 over every GPU;
  - weights: rank 0 holds the model's exported tensors (bf16, HF names) on its GPU and moves
    them to rank 1's GPU in buckets of `--bucket-mb`, (a) by NCCL broadcast of one flat buffer
    per bucket, (b) through host memory (pinned copy, a file in /dev/shm as the stand-in for
    the object store, then host -> device), against the measured device-to-device copy
    bandwidth on one GPU and between the two.

Every training phase runs the same SFT batch with the same learning rate: tokens/s per GPU are
compared to one GPU, and per-step losses must agree with one GPU within `--loss-rtol` (bf16).
On `--device cpu` the ranks use gloo and Megatron runs under the test suite's CUDA shims
(`tests/support/megatron_cpu.py`): that checks the logic, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def training_phases(gpus: int) -> list[tuple[str, int, str, dict]]:
    """(name, ranks, backend, megatron_cfg) for every training phase."""
    phases = [
        ("megatron tp=1", 1, "megatron", {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}),
        ("megatron tp=2", 2, "megatron", {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}),
        ("megatron pp=2", 2, "megatron", {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2}),
        ("megatron dp=2", 2, "megatron", {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}),
    ]
    if gpus >= 4:
        phases.append(("megatron tp=2 pp=2", 4, "megatron",
                       {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}))
    phases += [("dtensor dp=1", 1, "dtensor", {}), (f"dtensor fsdp={gpus}", gpus, "dtensor", {})]
    return phases


# --- worker side (one process per rank) ------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def model_folder(preset: str, device: torch.device) -> Path:
    from rlserve.models import resolve_model
    from rlserve.models.factory import make_model
    from rlserve.models.presets import get_preset

    if device.type == "cpu":
        return resolve_model(f"preset:{preset}")
    out = Path(tempfile.gettempdir()) / f"rlserve-bench-{preset}"
    if not (out / "rlserve_preset.json").is_file():
        torch.set_default_device(device)  # random init on the GPU: seconds instead of minutes
        make_model(get_preset(preset), out, seed=0)
        torch.set_default_device("cpu")
    return out


def sft_batch(args: argparse.Namespace, vocab: int):
    from rlserve.training.batch import TrainBatch

    ids = torch.randint(4, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return TrainBatch.from_sequences(ids.tolist(), [1] * args.batch)


def train_phase(args: argparse.Namespace, backend_name: str, megatron_cfg: dict, device: torch.device) -> dict:
    from transformers import AutoConfig

    from rlserve.config import parse_spec
    from rlserve.learner import make_backend

    path = Path(args.model)
    policy = {"precision": "bfloat16" if device.type == "cuda" else "float32",
              "max_total_sequence_length": args.seq, "train_micro_batch_size": args.micro_batch,
              "generation": {"max_new_tokens": 8}, "max_grad_norm": 1.0}
    if backend_name == "megatron":
        policy["megatron_cfg"] = {"enabled": True, **megatron_cfg}
    backend = make_backend(parse_spec({"policy": policy, "cluster": {"device": device.type}}), path, device)
    batch = sft_batch(args, AutoConfig.from_pretrained(path).vocab_size)
    losses, times = [], []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        result = backend.train_step(batch, "sft", args.lr)
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(result.metrics["loss/total"])
    timed = times[1:] or times  # the first step pays for allocator warm-up and lazy init
    step_s = sum(timed) / len(timed)
    tokens = args.batch * args.seq
    return {"layout": backend.info().parallel_layout, "losses": losses, "step_s": step_s,
            "tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": tokens / step_s / dist.get_world_size(),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}


def copy_gb_per_s(src: torch.Tensor, dst: torch.Tensor, device: torch.device, repeats: int = 5) -> float:
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return src.numel() * src.element_size() * repeats / (time.perf_counter() - t0) / 1e9


def exported_tensors(path: Path, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The HF-named bf16 tensors a learner export yields, resident on the learner's device."""
    from safetensors.torch import load_file

    return [(name, t.to(device, torch.bfloat16)) for name, t in sorted(load_file(path / "model.safetensors").items())]


def buckets(named: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    from rlserve.weights.buckets import BucketWriter

    plan: list[list[tuple[str, torch.Tensor]]] = []
    writer = BucketWriter(max_bytes, lambda bucket: plan.append(list(bucket.items())))
    for name, tensor in named:
        writer.add(name, tensor)
    writer.flush()
    return plan


def weights_phase(args: argparse.Namespace, device: torch.device, scratch: Path) -> dict | None:
    """Rank 0 -> rank 1: NCCL broadcast of flat bucket buffers vs a trip through host memory
    (files in `scratch`, a folder both ranks see; /dev/shm where there is one).

    Rank 1 zeroes its tensors before every transfer and both ranks compare checksums after it,
    so a transfer that moves the wrong bytes fails the phase."""
    from rlserve.weights.buckets import to_host

    rank = dist.get_rank()
    plan = buckets(exported_tensors(Path(args.model), device), args.bucket_mb * 2**20)
    tensors = [t for bucket in plan for _, t in bucket]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def broadcast() -> None:
        for bucket in plan:
            if rank == 0:
                flat = torch.cat([t.flatten() for _, t in bucket])
            else:
                flat = torch.empty(sum(t.numel() for _, t in bucket), dtype=torch.bfloat16, device=device)
            dist.broadcast(flat, src=0)
            if rank == 1:
                offset = 0
                for _, t in bucket:  # unflatten into the receiver's tensors
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def through_host(shm: Path) -> None:
        for i, bucket in enumerate(plan):
            file = shm / f"bucket{i}.pt"
            if rank == 0:
                torch.save({name: to_host(t) for name, t in bucket}, file)
            dist.barrier()
            if rank == 1:
                received = torch.load(file, weights_only=True)
                for name, t in bucket:
                    t.copy_(received[name])
                file.unlink()

    def checksum() -> torch.Tensor:
        return torch.stack([t.float().sum() for t in tensors]).sum().reshape(1)

    def timed(fn, *fn_args) -> float:
        fn(*fn_args)  # warm-up: NCCL channels, host allocator
        if rank == 1:
            for t in tensors:
                t.zero_()
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn(*fn_args)
        sync(device)
        dist.barrier()
        seconds = time.perf_counter() - t0
        sums = [torch.zeros(1, device=device) for _ in range(2)]
        dist.all_gather(sums, checksum())
        if not torch.equal(sums[0], sums[1]):
            raise RuntimeError(f"{fn.__name__}: the receiver's weights differ from the sender's")
        return seconds

    results = {"nccl_broadcast_s": timed(broadcast), "host_memory_s": timed(through_host, scratch)}
    if rank != 0:
        return None
    big = torch.empty(2**30, dtype=torch.uint8, device=device)
    results["d2d_same_gpu_gb_per_s"] = copy_gb_per_s(big, torch.empty_like(big), device)
    if device.type == "cuda":
        other = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
        results["d2d_peer_gpu_gb_per_s"] = copy_gb_per_s(big, torch.empty_like(big, device=other), device)
    gb = nbytes / 1e9
    return {"gb": gb, "buckets": len(plan), **results,
            "nccl_broadcast_s_per_gb": results["nccl_broadcast_s"] / gb,
            "host_memory_s_per_gb": results["host_memory_s"] / gb}


def worker(args: argparse.Namespace) -> None:
    from rlserve.training.distributed import device_for, init_process_group

    device = device_for(args.device, args.rank)
    init_process_group(args.rank, args.world, args.init, device)
    torch.manual_seed(0)
    phase = json.loads(args.worker)
    if phase["backend"] == "weights":
        result = weights_phase(args, device, Path(args.result).parent)
    elif phase["backend"] == "megatron" and device.type == "cpu":
        from tests.support.megatron_cpu import megatron_cpu_training  # dry run only: see the docstring

        with megatron_cpu_training():
            result = train_phase(args, "megatron", phase["megatron_cfg"], device)
    else:
        result = train_phase(args, phase["backend"], phase["megatron_cfg"], device)
    if args.rank == 0:
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    # Every rank has finished and rank 0's result is on disk. Gloo's teardown (destroy_process_group or the
    # interpreter's finalizers) aborted in one CI run on 2 busy cores with "terminate called without an
    # active exception" (pytorch/pytorch#179291 describes the race), failing a phase whose work was done and
    # checked; leaving without the teardown cannot lose anything.
    sys.stdout.flush()
    os._exit(0)


# --- driver side ------------------------------------------------------------------------------


def run_phase(args: argparse.Namespace, name: str, ranks: int, phase: dict) -> dict:
    """Start one process per rank, wait for all, return rank 0's result (or the error)."""
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    tmp = Path(tempfile.mkdtemp(prefix="rlserve-multigpu-", dir=shm))
    common = [sys.executable, __file__, "--worker", json.dumps(phase), "--world", str(ranks),
              "--init", f"file://{tmp / 'rdzv'}", "--result", str(tmp / "result.json"), "--model", args.model,
              "--device", args.device, "--seq", str(args.seq), "--batch", str(args.batch),
              "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--lr", str(args.lr),
              "--bucket-mb", str(args.bucket_mb)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    procs = [subprocess.Popen(common + ["--rank", str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(ranks)]
    try:
        outputs = [p.communicate(timeout=args.phase_timeout)[0] for p in procs]
        result = json.loads((tmp / "result.json").read_text()) if not any(p.returncode for p in procs) else None
    finally:
        for p in procs:
            p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    failed = [f"rank {r}: {out[-2000:]}" for r, (p, out) in enumerate(zip(procs, outputs)) if p.returncode]
    if failed:
        return {"phase": name, "ranks": ranks, "error": "\n".join(failed)}
    return {"phase": name, "ranks": ranks, **result}


def compare(rows: list[dict], loss_rtol: float) -> None:
    """Ratios against the one-GPU phase of the same backend; loss agreement step by step."""
    base = {r["phase"].split()[0]: r for r in rows if r.get("ranks") == 1 and "losses" in r}
    for r in rows:
        ref = base.get(r["phase"].split()[0])
        if "losses" not in r or ref is None:
            continue
        r["per_gpu_vs_1gpu"] = r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"]
        diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref["losses"])]
        r["max_loss_rel_diff"] = max(diffs)
        r["losses_match"] = r["max_loss_rel_diff"] <= loss_rtol


def print_table(rows: list[dict]) -> None:
    print(f"{'phase':22} {'tokens/s/GPU':>13} {'vs 1 GPU':>9} {'max loss diff':>14} {'peak GiB':>9}  layout")
    for r in rows:
        if "error" in r:
            print(f"{r['phase']:22} ERROR {r['error'].splitlines()[-1][:100]}")
        elif "losses" in r:
            mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") else "-"
            print(f"{r['phase']:22} {r['tokens_per_s_per_gpu']:13,.0f} {r.get('per_gpu_vs_1gpu', 1):9.2f} "
                  f"{r.get('max_loss_rel_diff', 0):14.2e} {mem:>9}  {r['layout'][:60]}")
        else:
            print(f"{r['phase']:22} {r['gb']:.3f} GB in {r['buckets']} buckets: NCCL broadcast "
                  f"{r['nccl_broadcast_s_per_gb']:.3f} s/GB, host memory {r['host_memory_s_per_gb']:.3f} s/GB; "
                  f"copy on one device {r['d2d_same_gpu_gb_per_s']:.0f} GB/s"
                  + (f", to the peer GPU {r['d2d_peer_gpu_gb_per_s']:.0f} GB/s" if "d2d_peer_gpu_gb_per_s" in r
                     else ""))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2, help="ranks for the widest phase")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--loss-rtol", type=float, default=2e-2, help="bf16; use ~1e-4 for the fp32 dry run")
    parser.add_argument("--phases", nargs="*", default=None, help="only the phases whose name starts so")
    parser.add_argument("--phase-timeout", type=float, default=900)
    parser.add_argument("--out", default=None)
    # worker mode (started by the driver)
    parser.add_argument("--worker", default=None)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--init", default=None)
    parser.add_argument("--result", default=None)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    if args.gpus < 2:
        raise SystemExit("--gpus must be at least 2")
    phases = [(name, ranks, {"backend": backend, "megatron_cfg": cfg})
              for name, ranks, backend, cfg in training_phases(args.gpus)]
    phases.append(("weights 0->1", 2, {"backend": "weights", "megatron_cfg": {}}))
    if args.phases:
        phases = [p for p in phases if any(p[0].startswith(prefix) for prefix in args.phases)]
    needed = max(ranks for _, ranks, _ in phases)
    if args.device == "cuda" and torch.cuda.device_count() < needed:
        raise SystemExit(f"the phases asked for need {needed} GPUs; this machine has {torch.cuda.device_count()}")
    args.model = str(model_folder(args.preset, torch.device(args.device)))
    rows = [run_phase(args, name, ranks, phase) for name, ranks, phase in phases]
    compare(rows, args.loss_rtol)
    print_table(rows)
    result = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (gloo dry run)",
              "torch": torch.__version__, "preset": args.preset, "seq": args.seq, "batch": args.batch,
              "micro_batch": args.micro_batch, "steps": args.steps, "lr": args.lr, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if any("error" in r or r.get("losses_match") is False for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
