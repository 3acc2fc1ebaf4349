"""User data sets as JSON lines or Parquet, in rlserve's row shape or a `datasets`-style one.

A row is `{prompt, answer}` or `{messages: [{role, content}, ...], answer}`, or a
chat conversation that ends with the assistant's turn (`{messages: [..., {role:
assistant, content}]}`: that turn is the answer, as in chat SFT files), with
optional `metadata` and `env_args` (a multi-turn environment's per-row arguments).
`data.columns` names the file's own columns for these fields
(`{prompt: question, answer: final_answer}` for a GSM8K-style file), so files
exported from HF `datasets` load as they are; their other columns are kept in
the example's metadata, where reward functions find them. Every error names the
file, the line (JSONL) or row (Parquet), and the column.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlserve.config.spec import DataCfg, DataColumnsCfg
from rlserve.data.tasks import Example


def text_of(value: Any, where: str, column: str) -> str:
    """Answers may be numbers in `datasets` files (an int64 column); prompts and contents are text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"{where}: column {column!r} must be a string, got {type(value).__name__}")
    return value


def messages_of(value: Any, where: str, column: str, answered: bool = False) -> tuple[dict[str, str], ...]:
    """A conversation; `answered`: it may end with the assistant's turn (then the row's answer)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: column {column!r} must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: {column}[{i}] must be an object with string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] == "assistant" and not answered:
        raise ValueError(f"{where}: {column} ends with an assistant message and the row has an answer column too; "
                         f"the conversation must end where the policy answers, with the reference answer either "
                         f"in the answer column or as the final assistant message")
    return tuple(out)


def example_from_row(row: Any, where: str, columns: DataColumnsCfg, chat: bool) -> Example:
    """One row -> an Example; `where` ("file:line" or "file: row N") prefixes every error."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each row must be an object")
    has_prompt, has_messages = row.get(columns.prompt) is not None, row.get(columns.messages) is not None
    if has_prompt == has_messages:
        what = "both" if has_prompt else "neither"
        raise ValueError(f"{where}: a row needs exactly one of the columns {columns.prompt!r} (prompt text) and "
                         f"{columns.messages!r} (chat messages), found {what} (columns: {', '.join(map(str, row))}; "
                         f"map yours with data.columns)")
    conversation = row.get(columns.messages)
    # A conversation that ends with the assistant's turn carries its answer (chat SFT files).
    answered = row.get(columns.answer) is None and isinstance(conversation, list) and bool(conversation) \
        and isinstance(conversation[-1], dict) and conversation[-1].get("role") == "assistant"
    if row.get(columns.answer) is None and not answered:
        raise ValueError(f"{where}: missing answer column {columns.answer!r} (columns: {', '.join(map(str, row))}; "
                         f"map yours with data.columns), and no final assistant message to take it from")
    answer = "" if answered else text_of(row[columns.answer], where, columns.answer)
    messages = None
    if has_prompt:
        prompt = text_of(row[columns.prompt], where, columns.prompt)
        if not prompt:
            raise ValueError(f"{where}: column {columns.prompt!r} is empty")
    elif not chat:
        raise ValueError(f"{where}: a row with chat messages ({columns.messages!r}) needs data.prompt_format: chat")
    else:
        messages = messages_of(row[columns.messages], where, columns.messages, answered)
        if answered:
            messages, answer = messages[:-1], messages[-1]["content"]
            if not messages:
                raise ValueError(f"{where}: {columns.messages} holds only an assistant message; nothing prompts it")
        users = [m["content"] for m in messages if m["role"] == "user"]
        prompt = users[-1] if users else messages[-1]["content"]
    metadata = row.get(columns.metadata) or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: column {columns.metadata!r} must be an object")
    env_args = row.get(columns.env_args) or {}
    if not isinstance(env_args, dict):
        raise ValueError(f"{where}: column {columns.env_args!r} must be an object (the environment's arguments)")
    used = {columns.prompt, columns.messages, columns.answer, columns.metadata, columns.env_args}
    extra = {k: v for k, v in row.items() if k not in used}
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: the columns beyond the mapped ones are kept as metadata and must be JSON "
                         f"values: {err}") from None
    return Example(prompt, answer, {**extra, **metadata}, messages, env_args)


def jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {err.msg}") from None


def parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for unreadable files
        raise ValueError(f"{path}: not a readable Parquet file: {err}") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}: row {i}", row


def load_examples(path: str | Path, cfg: DataCfg) -> list[Example]:
    """Read every example of a `jsonl` or `parquet` file (`data.task`) with `data.columns`."""
    path, fmt = Path(path), cfg.task
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if fmt == "jsonl" and path.suffix == ".parquet":
        raise ValueError(f"{path}: a Parquet file; set data.task: parquet")
    rows = {"jsonl": jsonl_rows, "parquet": parquet_rows}[fmt](path)
    examples = [example_from_row(row, where, cfg.columns, cfg.prompt_format == "chat") for where, row in rows]
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples
