"""Shared test set-up: GPU tests are skipped without CUDA; generated models go to a per-session cache."""

from __future__ import annotations

import os
import tempfile

import pytest

# Models that tests generate (preset:tiny, ...) are cached per test session, not in ~/.cache.
os.environ.setdefault("RLSERVE_MODEL_CACHE", tempfile.mkdtemp(prefix="rlserve-test-models-"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU-only test)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
