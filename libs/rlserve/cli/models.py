"""`rlserve make-model`: write a generated HF model folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlserve.models import PRESETS, get_preset


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a generated Llama/Mixtral-shaped HF model folder")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=make)


def make(args: argparse.Namespace) -> int:
    from rlserve.models.factory import make_model

    preset = get_preset(args.preset)
    if args.out_dir.exists() and any(args.out_dir.iterdir()):
        print(f"{args.out_dir}: exists and is not empty", file=sys.stderr)
        return 1
    make_model(preset, args.out_dir, seed=args.seed)
    n_bytes = sum(p.stat().st_size for p in args.out_dir.glob("*.safetensors"))
    print(f"{args.out_dir}: preset {preset.name}, seed {args.seed}, {n_bytes / 2**20:.1f} MiB of weights")
    return 0
