"""Processes that resolve one `preset:` name at once (services starting together) get one folder."""

from __future__ import annotations

import multiprocessing

from rlserve.models import resolve_model


def _resolve_and_hash(cache_dir: str) -> str:
    import hashlib
    import os
    os.environ["RLSERVE_MODEL_CACHE"] = cache_dir
    return hashlib.sha256((resolve_model("preset:tiny", seed=5) / "model.safetensors").read_bytes()).hexdigest()


def test_processes_resolving_one_preset_at_once_get_one_folder(tmp_path):
    """Services start together and resolve the same `preset:` name; they must not race."""
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        hashes = pool.map(_resolve_and_hash, [str(tmp_path)] * 3)
    assert len(set(hashes)) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["tiny-seed5"]
