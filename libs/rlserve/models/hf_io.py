"""Write policies as HF folders that vLLM, transformers and `policy.model_name` accept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

# The input model's weights (replaced by the policy's) and rlserve's own markers are not carried over.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def side_files(template: Path) -> list[Path]:
    """Every file of the input model folder but its weights: config, generation config, tokenizer
    files of any kind (tokenizer.json, merges/vocab, sentencepiece models), chat templates."""
    return sorted(p for p in template.iterdir()
                  if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name not in _WEIGHT_INDEXES
                  and not p.name.startswith(("rlserve_", ".")))


def write_hf_folder(path: Path, tensors: dict[str, torch.Tensor], template: Path, meta: dict) -> None:
    """The template's side files plus these HF-named weights (one safetensors file)."""
    path.mkdir(parents=True, exist_ok=True)
    for src in side_files(template):
        shutil.copy(src, path / src.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "rlserve_export.json").write_text(json.dumps(meta) + "\n")
