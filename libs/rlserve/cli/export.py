"""`rlserve export RUN`: a run's final policy, as its adapter or merged into an HF folder.

A LoRA run's final policy is a PEFT adapter folder (`final_model/`: what peft
and vLLM load on the base model); `--merge` writes the base with the adapter
merged in as a plain HF folder. A full-parameter run's final policy is an HF
folder already. Runs on the local filesystem (the cluster's runs directory).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's final policy (a LoRA run's adapter, or merged with --merge)")
    p.add_argument("run", help="a run id (in --runs-dir) or a run directory")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="the cluster's runs directory (default: runs)")
    p.add_argument("--merge", action="store_true", help="merge a LoRA adapter into its base model")
    p.add_argument("--out", type=Path, help="where to write it (default: <run dir>/final_model_merged with --merge)")
    p.set_defaults(func=export)


def export(args: argparse.Namespace) -> int:
    from rlserve.config import load_spec
    from rlserve.weights import adapter

    run_dir = Path(args.run) if Path(args.run).is_dir() else args.runs_dir / args.run
    final = run_dir / "final_model"
    if not (run_dir / "spec.yaml").is_file() or not final.is_dir():
        print(f"{run_dir}: no finished run there (spec.yaml and final_model/)", file=sys.stderr)
        return 1
    if args.merge and adapter.is_adapter_folder(final):
        out = args.out or run_dir / "final_model_merged"
        merge(load_spec((run_dir / "spec.yaml").read_text()), final, out)
    else:
        if args.merge:
            print(f"{final}: a full-parameter run's policy, an HF folder already (nothing to merge)", file=sys.stderr)
        out = args.out or final
        if out != final:
            shutil.copytree(final, out, dirs_exist_ok=True)
    print(out)
    return 0


def merge(spec, adapter_folder: Path, out: Path) -> None:
    """The base model of `spec` with the adapter merged into its weights, saved with the base's tokenizer."""
    import torch
    from peft import PeftModel

    from rlserve.models import resolve_model
    from rlserve.models.architecture import load_causal_lm
    from rlserve.models.hf_io import side_files

    base_path = resolve_model(spec.policy.model_name, spec.policy.model_seed)
    model = PeftModel.from_pretrained(load_causal_lm(base_path, torch.float32), adapter_folder).merge_and_unload()
    model.save_pretrained(out)
    for src in side_files(base_path):
        if not (out / src.name).exists():
            shutil.copy(src, out / src.name)
