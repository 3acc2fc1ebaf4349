"""Write policies as HF folders that vLLM, transformers and `policy.model_name` accept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")


def write_hf_folder(path: Path, tensors: dict[str, torch.Tensor], template: Path, meta: dict) -> None:
    """The template's config and tokenizer files plus these HF-named weights (one safetensors file)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in _SIDE_FILES:
        if (template / name).is_file():
            shutil.copy(template / name, path / name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "rlserve_export.json").write_text(json.dumps(meta) + "\n")
