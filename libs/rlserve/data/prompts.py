"""Prompt text -> token ids with the policy's own tokenizer (`tokenizer.json` of the HF folder)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class PromptTokenizer:
    """The policy's own tokenizer, for prompts and SFT answers."""

    def __init__(self, model_dir: Path):
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "config.json").read_text())
        self.eos_id = int(config["eos_token_id"])

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids
