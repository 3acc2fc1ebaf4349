"""Rollout-training consistency per engine, precision and model, with and without MoE routing replay.

For each configuration an engine samples a GRPO-shaped batch (temperature 1, `--prompts` x `--samples`,
`--new-tokens` tokens, the transformers engine recording every position's experts on a MoE model), and the
dtensor learner, at the same precision on the same device, scores the batch at the start of a step as a
TrainStep does (`StepObjective`'s micro-batches through the backend's forward): once routing itself and,
for a MoE model on the transformers engine, once replaying the recorded experts. The numbers are the
step's consistency metrics (`rlserve.algorithms.mismatch`: NeMo-RL's token_mult_prob_error, the k3
generator KL, mean and max |delta logprob|) and, for MoE, the share of (position, layer) pairs whose
experts the learner's own routing chose differently from the engine's.

    .venv/bin/python scripts/bench/consistency.py                         # CPU: both engines, fp32 and bf16
    python3 scripts/bench/consistency.py --device cuda --engines transformers \\
        --models 1b qwen3-moe-gpu --prompts 64 --samples 8 --new-tokens 256  # the H200 stage (h200_run.sh)

Models: presets (`tiny`, `moe-tiny` (Mixtral-shaped), `qwen3-moe-tiny`, `1b`), and Qwen3-MoE shapes generated
here with many experts (`qwen3-moe-wide`: 4 layers of 64 experts, top-8, for the CPU; `qwen3-moe-gpu`: 8 layers
of 128, top-8, hidden 1024), since near-tied routers, what replay is for, come with many experts and no
preset has them. Weights are random: their routers' margins are not a trained model's, so the flip rates
say how replay behaves, not what a trained model would show.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import record, table  # noqa: E402

COLUMNS = ["device", "engine", "dtype", "model", "replay", "tokens", "token_mult_prob_error", "gen_kl_k3",
           "logprob_abs_diff_mean", "logprob_abs_diff_max", "routing_flips", "seconds"]
# MoE shapes generated here (no preset has many experts): near-tied routers are what routing replay is for,
# and they come with many experts per layer (Qwen3-30B-A3B: 128, top-8).
GENERATED = {
    "qwen3-moe-wide": dict(architecture="qwen3_moe", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                           ffn_size=64, max_position_embeddings=512, tie_word_embeddings=False, num_experts=64,
                           experts_per_token=8),
    "qwen3-moe-gpu": dict(architecture="qwen3_moe", hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                          ffn_size=512, max_position_embeddings=4096, tie_word_embeddings=False,
                          padded_vocab_size=32000, num_experts=128, experts_per_token=8),
}


def model_path(name: str, work: Path) -> Path:
    from rlserve.models import resolve_model

    if name not in GENERATED:
        return resolve_model(f"preset:{name}")
    from rlserve.models.factory import make_model
    from rlserve.models.presets import ModelPreset

    path = work / name
    if not (path / "config.json").is_file():
        make_model(ModelPreset(name=name, **GENERATED[name]), path)
    return path


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, min(vocab, 60), (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


async def sample(engine_name: str, path: Path, dtype: str, device: str, moe: bool, args) -> list:
    """[(prompt, GeneratedSample)] from one engine started for this configuration."""
    from rlserve.rollout import make_engine
    from rlserve.rollout.interfaces import EngineConfig, SamplingSpec

    engine = make_engine(engine_name, EngineConfig(model_path=path, dtype=dtype, device=device,
                                                   max_model_len=args.new_tokens + 32,
                                                   gpu_memory_utilization=0.3))
    try:
        record_routes = moe and engine.routing_unavailable == ""
        asked = prompts(args.prompts, engine.info().vocab_size, args.seed)
        out = await engine.generate(asked, args.samples, SamplingSpec(
            temperature=1.0, max_new_tokens=args.new_tokens, seed=args.seed, routed_experts=record_routes))
        return [(p, s) for p, ss in zip(asked, out) for s in ss]
    finally:
        await engine.close()


def batch_of(samples: list, with_routes: bool):
    """The samples as the TrainBatch a step would train (routes: the engine's record, -1 past it)."""
    import torch

    from rlserve.training.batch import TrainBatch

    kept = [(p, s) for p, s in samples if s.token_ids]
    routes = None
    if with_routes:
        routes = []
        for p, s in kept:
            full = torch.full((len(p) + len(s.token_ids), *s.routed_experts.shape[1:]), -1, dtype=torch.int16)
            full[:len(s.routed_experts)] = s.routed_experts
            routes.append(full)
    return TrainBatch.from_sequences([p + s.token_ids for p, s in kept], [len(p) for p, _ in kept],
                                     [0.0] * len(kept), [s.logprobs for _, s in kept], routed_experts=routes)


def measure(samples: list, path: Path, dtype: str, device: str, replay: bool, args) -> dict[str, float]:
    """The learner's start-of-step view of the samples (replaying the engine's routes or routing itself): the
    consistency metrics, and for MoE the share of recorded (position, layer) decisions its own routing
    makes differently (0 under replay)."""
    import torch

    from rlserve.algorithms.metrics import finalize_metrics, reduce_metric_sums
    from rlserve.algorithms.mismatch import mismatch_sums
    from rlserve.config import parse_spec
    from rlserve.learner.registry import make_backend
    from rlserve.models import moe_routing
    from rlserve.training.objective import StepObjective

    recorded_routes = samples[0][1].routed_experts is not None
    batch = batch_of(samples, recorded_routes)
    spec = parse_spec({"policy": {"model_name": str(path), "precision": dtype,
                                  "max_total_sequence_length": int(batch.seq_lens.max()) + 8,
                                  "train_micro_batch_size": args.micro_batch, "routing_replay": replay,
                                  "generation": {"max_new_tokens": args.new_tokens}},
                       "cluster": {"device": device}})
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    backend = make_backend(spec, path, dev)
    objective = StepObjective(spec, batch, "grpo", 1, 0, backend.pad_id)
    sums, flips, pairs = [], 0, 0
    with torch.no_grad():
        for plan in objective.plans:
            for mb in plan:
                record_ = mb.routed_experts
                if not replay:
                    mb.routed_experts = None  # the learner routes itself
                with moe_routing.capture(backend.model.lm) as calls:
                    lps = backend._logprobs(mb)
                sums.append(mismatch_sums(lps, mb.gen_logprobs.to(dev), torch.ones_like(lps, dtype=torch.bool),
                                          spec.loss_fn))
                if calls and record_ is not None:
                    own = torch.stack([c[0] for c in calls], dim=1)  # [rows, layers, k] as routed in this pass
                    want = moe_routing.rows(record_)
                    recorded = (want >= 0).all(-1)
                    differs = (own.long().sort(-1).values != want.long().sort(-1).values).any(-1)
                    flips += int((differs & recorded).sum())
                    pairs += int(recorded.sum())
    metrics = finalize_metrics(reduce_metric_sums(sums))
    out = {k.removeprefix("mismatch/"): v for k, v in metrics.items() if k.startswith("mismatch/")}
    out["tokens"] = int(batch.completion_lens.sum())
    out["routing_flips"] = flips / pairs if pairs else "-"
    del backend
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--engines", nargs="+", default=["transformers", "vllm"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--models", nargs="+", default=["tiny", "moe-tiny", "qwen3-moe-tiny", "qwen3-moe-wide"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", default="consistency")
    args = parser.parse_args()

    import torch

    from rlserve.models import hf_config
    from rlserve.models.architecture import num_experts
    from rlserve.training.distributed import init_process_group

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    if args.device == "cuda":
        torch.cuda.set_device(0)
    init_process_group(0, 1, f"file://{tempfile.mktemp(prefix='rlserve-consistency-')}",
                       torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu"))
    work = Path(tempfile.mkdtemp(prefix="rlserve-consistency-models-"))
    rows = []
    for model in args.models:
        path = model_path(model, work)
        moe = bool(num_experts(hf_config(str(path))))
        for engine in args.engines:
            for dtype in args.dtypes:
                base = {"device": args.device, "engine": engine, "dtype": dtype, "model": model}
                t0 = time.perf_counter()
                try:
                    samples = asyncio.run(sample(engine, path, dtype, args.device, moe, args))
                except Exception as err:  # noqa: BLE001 - a configuration an engine cannot run is a row saying so
                    rows.append({**base, "replay": "-", "token_mult_prob_error": f"n/a: {str(err)[:80]}"})
                    print(table(rows[-1:], COLUMNS), flush=True)
                    continue
                recorded = moe and samples[0][1].routed_experts is not None
                for replay in ([False, True] if recorded else [False]):
                    got = measure(samples, path, dtype, args.device, replay, args)
                    got["token_mult_prob_error"] = f"{got['token_mult_prob_error']:.7f}"  # the table shows 7 places
                    rows.append({**base, "replay": ("on" if replay else "off") if moe else "-",
                                 "seconds": time.perf_counter() - t0, **got})
                    print(table(rows[-1:], COLUMNS), flush=True)
    print(table(rows, COLUMNS))
    print("wrote", record(args.out, rows, {"args": vars(args)}))


if __name__ == "__main__":
    main()
