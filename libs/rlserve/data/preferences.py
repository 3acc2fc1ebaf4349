"""Preference data for DPO: rows of a prompt with a chosen and a rejected response.

A row is `{prompt, chosen, rejected}` (TRL's and HF's preference format), the
prompt as text or as chat `messages`, each response as text or as a list
holding one assistant message (TRL's conversational format). `data.columns`
names the file's own columns. Every error names the file, the line (JSONL)
or row (Parquet), and the column.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlserve.config.spec import DataCfg, DataColumnsCfg
from rlserve.data.files import jsonl_rows, messages_of, parquet_rows, text_of
from rlserve.data.tasks import Example


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    # A chat row's conversation up to the response ({"role", "content"} each).
    messages: tuple[dict[str, str], ...] | None = None

    def example(self, response: str) -> Example:
        """The prompt with one of its responses as the answer (what `PromptTokenizer.sft_ids` encodes)."""
        return Example(self.prompt, response, {}, self.messages)


@dataclass(frozen=True)
class PreferenceSplits:
    train: list[PreferencePair]
    val: list[PreferencePair]


def _response(value: Any, where: str, column: str) -> str:
    """A response: text, or [{"role": "assistant", "content": ...}] (TRL's conversational rows)."""
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], dict) or value[0].get("role") != "assistant" \
                or not isinstance(value[0].get("content"), str):
            raise ValueError(f"{where}: column {column!r} must be text or a list of one assistant message")
        return value[0]["content"]
    return text_of(value, where, column)


def pair_from_row(row: Any, where: str, columns: DataColumnsCfg, chat: bool) -> PreferencePair:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each row must be an object")
    missing = [c for c in (columns.chosen, columns.rejected) if row.get(c) is None]
    if missing:
        raise ValueError(f"{where}: missing column {missing[0]!r} (columns: {', '.join(map(str, row))}; map yours "
                         f"with data.columns)")
    has_prompt, has_messages = row.get(columns.prompt) is not None, row.get(columns.messages) is not None
    if has_prompt == has_messages:
        raise ValueError(f"{where}: a row needs exactly one of the columns {columns.prompt!r} (prompt text) and "
                         f"{columns.messages!r} (chat messages)")
    messages = None
    if has_prompt:
        prompt = text_of(row[columns.prompt], where, columns.prompt)
    elif not chat:
        raise ValueError(f"{where}: a row with chat messages ({columns.messages!r}) needs data.prompt_format: chat")
    else:
        messages = messages_of(row[columns.messages], where, columns.messages)
        prompt = messages[-1]["content"]
    return PreferencePair(prompt, _response(row[columns.chosen], where, columns.chosen),
                          _response(row[columns.rejected], where, columns.rejected), messages)


def load_pairs(path: str | Path, cfg: DataCfg) -> list[PreferencePair]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    rows = {"jsonl": jsonl_rows, "parquet": parquet_rows}[cfg.task](path)
    pairs = [pair_from_row(row, where, cfg.columns, cfg.prompt_format == "chat") for where, row in rows]
    if not pairs:
        raise ValueError(f"{path}: no preference pairs")
    return pairs


def build_preference_splits(cfg: DataCfg) -> PreferenceSplits:
    """Validation pairs from data.val_path, or the first data.num_val (at most a tenth) of a shuffled train file."""
    train = load_pairs(cfg.train_path, cfg)
    if cfg.val_path:
        return PreferenceSplits(train, load_pairs(cfg.val_path, cfg)[: cfg.num_val])
    shuffled = train[:]
    random.Random(cfg.seed).shuffle(shuffled)
    n_val = min(cfg.num_val, max(1, len(shuffled) // 10))
    return PreferenceSplits(shuffled[n_val:], shuffled[:n_val])
