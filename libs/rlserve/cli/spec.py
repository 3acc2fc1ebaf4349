"""`rlserve validate SPEC.yaml`: check a run spec without a cluster."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlserve.config import SpecError, load_spec, spec_to_yaml


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check a run spec; exit 0 when it is valid")
    p.add_argument("spec", type=Path)
    p.add_argument("--print", action="store_true", help="print the spec with every default filled in")
    p.set_defaults(func=validate)


def validate(args: argparse.Namespace) -> int:
    if not args.spec.is_file():
        print(f"{args.spec}: no such file", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
    except SpecError as err:
        print(f"{args.spec}: {err}", file=sys.stderr)
        return 1
    if args.print:
        print(spec_to_yaml(spec), end="")
    else:
        print(f"{args.spec}: valid ({spec.policy.backend} learner, {spec.batch_size} trajectories/step, "
              f"max staleness {spec.grpo.max_age})")
    return 0
