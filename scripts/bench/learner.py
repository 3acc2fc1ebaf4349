"""Learner benchmark on CPU: DTensor backend tokens/s with sequence packing on vs off, for the
`tiny` and `small` presets, in one run on the same GRPO batch (one rank, gloo).

`--shape rollouts` (the default) mimics GRPO rollouts: short prompts and completions of very
different lengths, so padding wastes compute that packing saves. `--shape demo` is `make demo`'s
step: 512 sequences (64 prompts x 8), prompts of 7-9 tokens and 2-6 new tokens, two updates of
256. tokens/s counts real tokens only.

    .venv/bin/python scripts/bench/learner.py [--presets tiny small] [--steps 3] [--shape demo]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.common import record, table, timed  # noqa: E402


def grpo_batch(n: int, seed: int = 0):
    import torch

    from rlserve.training.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    seqs, prompts, gen = [], [], []
    for _ in range(n):
        p = int(torch.randint(6, 12, (1,), generator=g))
        c = int(torch.randint(1, 100, (1,), generator=g)) if torch.rand(1, generator=g) < 0.2 else \
            int(torch.randint(1, 12, (1,), generator=g))
        seqs.append(torch.randint(4, 60, (p + c,), generator=g).tolist())
        prompts.append(p)
        gen.append([-1.0] * c)
    return TrainBatch.from_sequences(seqs, prompts, torch.randn(n, generator=g).tolist(), gen)


def demo_batch(n: int, seed: int = 0):
    import random

    from rlserve.training.batch import TrainBatch

    rng = random.Random(seed)
    seqs, prompts, gen = [], [], []
    for _ in range(n):
        p, c = rng.randint(7, 9), rng.randint(2, 6)
        seqs.append([rng.randint(4, 40) for _ in range(p + c)])
        prompts.append(p)
        gen.append([-1.0] * c)
    return TrainBatch.from_sequences(seqs, prompts, [rng.gauss(0, 1) for _ in range(n)], gen)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=None, help="default: 256 (rollouts), 512 (demo)")
    parser.add_argument("--shape", choices=["rollouts", "demo"], default="rollouts")
    args = parser.parse_args()
    demo = args.shape == "demo"
    args.sequences = args.sequences or (512 if demo else 256)

    import torch

    from rlserve.config import parse_spec
    from rlserve.learner.dtensor.backend import DTensorBackend
    from rlserve.models import resolve_model
    from rlserve.training.distributed import init_process_group

    torch.set_num_threads(2)
    init_process_group(0, 1, f"file://{tempfile.mktemp()}", torch.device("cpu"))
    batch = demo_batch(args.sequences) if demo else grpo_batch(args.sequences)
    real_tokens = int(batch.seq_lens.sum())
    rows = []
    for preset in args.presets:
        results = {}
        for packed in (False, True):
            policy = ({"max_total_sequence_length": 32, "train_global_batch_size": args.sequences // 2,
                       "train_micro_batch_size": args.sequences // 2, "sequence_packing": {"enabled": packed}}
                      if demo else {"max_total_sequence_length": 128, "train_micro_batch_size": 32,
                                    "sequence_packing": {"enabled": packed, "train_mb_tokens": 1024}})
            spec = parse_spec({"policy": policy})
            backend = DTensorBackend(spec, resolve_model(f"preset:{preset}"), torch.device("cpu"))
            seconds, _ = timed(lambda: backend.train_step(batch, "grpo"), args.steps)
            results[packed] = seconds
            backend = None  # free it before the next layout
        for packed, seconds in results.items():
            rows.append({"preset": preset, "packing": "on" if packed else "off", "seconds_per_step": seconds,
                         "tokens_per_s": real_tokens / seconds, "speedup_vs_padded": results[False] / seconds})
    print(table(rows, ["preset", "packing", "seconds_per_step", "tokens_per_s", "speedup_vs_padded"]))
    print("wrote", record(f"learner_cpu_{args.shape}", rows, {"sequences": args.sequences, "real_tokens": real_tokens,
                                                              "steps": args.steps, "threads": 2}))


if __name__ == "__main__":
    main()
