"""Generated tiny models, their tokenizer, and name resolution for `policy.model_name`."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from rlserve.models.presets import PRESETS, ModelPreset, get_preset

__all__ = ["PRESETS", "ModelPreset", "get_preset", "hf_config", "model_cache_dir", "resolve_model"]


def model_cache_dir() -> Path:
    return Path(os.environ.get("RLSERVE_MODEL_CACHE", Path.home() / ".cache" / "rlserve" / "models"))


def hf_config(model_name: str):
    """The HF config of `policy.model_name` without building the model: the folder's config.json, or a
    preset's architecture (without generating it)."""
    if model_name.startswith("preset:"):
        from rlserve.models.factory import architecture_config

        return architecture_config(get_preset(model_name.removeprefix("preset:")))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(Path(model_name))


def resolve_model(model_name: str, seed: int = 0) -> Path:
    """Map `policy.model_name` to an HF folder, generating `preset:NAME` models on first use.

    Generation is deterministic in (preset, seed), happens once under a file
    lock, and lands atomically (rename), so processes that resolve the same
    name at the same time wait for one another and load the same folder.
    """
    if not model_name.startswith("preset:"):
        path = Path(model_name).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"policy.model_name: {model_name!r} is not an HF model folder (no config.json)")
        return path
    from rlserve.models.factory import make_model

    preset = get_preset(model_name.removeprefix("preset:"))
    target = model_cache_dir() / f"{preset.name}-seed{seed}"
    if (target / "rlserve_preset.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "rlserve_preset.json").is_file():
            return target  # another process made it while this one waited
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            make_model(preset, tmp, seed=seed)
            shutil.rmtree(target, ignore_errors=True)  # a leftover without its marker
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
