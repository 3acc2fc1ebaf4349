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
    if spec.policy.lora.enabled and not _lora_fits(args.spec, spec):
        return 1
    if args.print:
        print(spec_to_yaml(spec), end="")
    else:
        print(f"{args.spec}: valid ({spec.policy.backend} learner, {spec.batch_size} trajectories/step, "
              f"{_staleness(spec)})")
    return 0


def _staleness(spec) -> str:
    if spec.grpo.async_grpo.enabled == "auto":
        return (f"max staleness {spec.grpo.max_age(cores_shared=False)}, or 0 where generation and training "
                "share CPU cores")
    return f"max staleness {spec.grpo.max_age(cores_shared=False)}"


def _lora_fits(path: Path, spec) -> bool:
    """A LoRA section against the model's layers, where the model is here to read (a preset, or a folder
    on this machine); otherwise SubmitRun checks it on the cluster."""
    from rlserve.learner.lora import LoraMismatch, check_lora
    from rlserve.models import hf_config

    try:
        config = hf_config(spec.policy.model_name)
    except (OSError, ValueError):
        print(f"{path}: note: {spec.policy.model_name} is not here; SubmitRun checks the LoRA targets against it",
              file=sys.stderr)
        return True
    try:
        check_lora(spec, config)
    except LoraMismatch as err:
        print(f"{path}: invalid spec:\n  - {err}", file=sys.stderr)
        return False
    return True
