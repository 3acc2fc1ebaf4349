"""User data sets as JSON lines: {"prompt": ..., "answer": ..., "metadata": {...}}."""

from __future__ import annotations

import json
from pathlib import Path

from rlserve.data.tasks import Example


def load_jsonl(path: str | Path) -> list[Example]:
    """Read examples; a bad line raises ValueError naming the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    examples = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not valid JSON: {err.msg}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
        unknown = set(row) - {"prompt", "answer", "metadata"}
        if unknown:
            raise ValueError(f"{path}:{lineno}: unknown keys {sorted(unknown)} (allowed: prompt, answer, metadata)")
        for key in ("prompt", "answer"):
            if not isinstance(row.get(key), str) or (key == "prompt" and not row[key]):
                raise ValueError(f"{path}:{lineno}: '{key}' must be a non-empty string")
        metadata = row.get("metadata", {})
        if not isinstance(metadata, dict):
            raise ValueError(f"{path}:{lineno}: 'metadata' must be an object")
        examples.append(Example(row["prompt"], row["answer"], metadata))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples
