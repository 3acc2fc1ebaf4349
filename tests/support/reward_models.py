"""Tiny generated reward models for tests: a sequence classifier on the `tiny` preset's shape and tokenizer
(an HF `AutoModelForSequenceClassification` folder, as a user's trained reward model would be)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def make_classifier(folder: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """A randomly initialised LlamaForSequenceClassification with the `tiny` preset's config and tokenizer."""
    from transformers import AutoConfig, LlamaForSequenceClassification

    from rlserve.models import resolve_model

    base = resolve_model("preset:tiny")
    config = AutoConfig.from_pretrained(base)
    config.num_labels = num_labels
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    return folder
