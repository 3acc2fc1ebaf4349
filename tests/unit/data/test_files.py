"""Data files: rlserve rows and chat rows, `datasets`-style files through data.columns (JSONL and
Parquet), and errors that name the file, the line or row, and the column."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlserve.config.spec import DataCfg, RunSpec
from rlserve.data.dataset import build_splits
from rlserve.data.files import load_examples

GSM8K_ROWS = [  # the shape of HF's gsm8k export: question, a worked answer ending in "#### N", more columns
    {"question": "Tom has 3 apples and buys 4 more. How many now?", "answer": "3 + 4 = 7\n#### 7", "level": 1},
    {"question": "A box holds 12 eggs. How many in 2 boxes?", "answer": "12 * 2 = 24\n#### 24", "level": 2},
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg(path, **kw) -> DataCfg:
    return DataCfg(task=kw.pop("task", "jsonl"), train_path=str(path), **kw)


def test_prompt_rows_and_chat_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2", "metadata": {"k": 1}},
                                              {"messages": CHAT, "answer": "4"}])
    plain, chat = load_examples(path, cfg(path, prompt_format="chat"))
    assert (plain.prompt, plain.answer, plain.metadata, plain.messages) == ("1+1=", "2", {"k": 1}, None)
    assert chat.messages == tuple(CHAT) and chat.prompt == "2+2=" and chat.answer == "4"
    with pytest.raises(ValueError, match=r"d.jsonl:2: .*needs data.prompt_format: chat"):
        load_examples(path, cfg(path))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_datasets_style_files_load_through_a_column_mapping(tmp_path, fmt):
    path = tmp_path / f"gsm8k.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, GSM8K_ROWS)
    else:
        pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), path)
    spec = RunSpec.model_validate({"data": {"task": fmt, "train_path": str(path), "val_path": str(path),
                                            "columns": {"prompt": "question", "answer": "answer"}}})
    splits = build_splits(spec.data)
    assert [ex.prompt for ex in splits.train] == [r["question"] for r in GSM8K_ROWS]
    assert splits.train[1].answer.endswith("#### 24") and splits.train[1].metadata == {"level": 2}


def test_parquet_chat_rows_and_numeric_answers(tmp_path):
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"conversation": CHAT, "target": 4}]), path)
    [ex] = load_examples(path, cfg(path, task="parquet", prompt_format="chat",
                                   columns={"messages": "conversation", "answer": "target"}))
    assert ex.messages == tuple(CHAT) and ex.answer == "4"


@pytest.mark.parametrize("row, message", [
    ({"question": "q"}, r"bad.jsonl:2: missing answer column 'final_answer' \(columns: question"),
    ({"answer": "1"}, r"bad.jsonl:2: a row needs exactly one of the columns 'question' .* found neither"),
    ({"question": "q", "messages": CHAT, "final_answer": "1"}, r"bad.jsonl:2: .* found both"),
    ({"question": ["q"], "final_answer": "1"}, r"bad.jsonl:2: column 'question' must be a string"),
    ({"messages": [{"role": "user"}], "final_answer": "1"}, r"bad.jsonl:2: messages\[0\] must be an object"),
    ({"messages": [*CHAT, {"role": "assistant", "content": "4"}], "final_answer": "4"},
     r"bad.jsonl:2: messages ends with an assistant message"),
    ({"question": "q", "final_answer": "1", "metadata": [1]}, r"bad.jsonl:2: column 'metadata' must be an object"),
])
def test_bad_rows_name_the_file_line_and_column(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "ok", "final_answer": "1"}, row])
    with pytest.raises(ValueError, match=message):
        load_examples(path, cfg(path, prompt_format="chat", columns={"prompt": "question", "answer": "final_answer"}))


def test_rows_carry_initial_messages_and_environment_arguments(tmp_path):
    path = write_jsonl(tmp_path / "env.jsonl", [
        {"messages": CHAT, "answer": "4", "env_args": {"target": 4, "max_number": 9}},
        {"prompt": "guess", "answer": "2"}])
    chat, plain = load_examples(path, cfg(path, prompt_format="chat"))
    assert chat.messages == tuple(CHAT) and chat.env_args == {"target": 4, "max_number": 9}
    assert plain.env_args == {} and "env_args" not in chat.metadata
    bad = write_jsonl(tmp_path / "bad_env.jsonl", [{"prompt": "p", "answer": "1", "env_args": [1]}])
    with pytest.raises(ValueError, match=r"bad_env.jsonl:1: column 'env_args' must be an object"):
        load_examples(bad, cfg(bad))


def test_bad_files_are_named(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"prompt": "a", "answer": "b"}\n{oops\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: not valid JSON"):
        load_examples(tmp_path / "x.jsonl", cfg(tmp_path / "x.jsonl"))
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"x.parquet: not a readable Parquet file"):
        load_examples(tmp_path / "x.parquet", cfg(tmp_path / "x.parquet", task="parquet"))
    with pytest.raises(ValueError, match=r"x.parquet: a Parquet file; set data.task: parquet"):
        load_examples(tmp_path / "x.parquet", cfg(tmp_path / "x.parquet"))
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "b"}, {"prompt": "c", "answer": None}]),
                   tmp_path / "y.parquet")
    with pytest.raises(ValueError, match=r"y.parquet: row 1: missing answer column 'answer'"):
        load_examples(tmp_path / "y.parquet", cfg(tmp_path / "y.parquet", task="parquet"))


@pytest.mark.parametrize("data, message", [
    ({"columns": {"prompt": "question"}}, "data.columns: only for data files"),
    ({"task": "jsonl", "train_path": "x", "columns": {"promt": "q"}}, "promt"),
    ({"system_prompt": "hi"}, "data.system_prompt: needs data.prompt_format: chat"),
    ({"prompt_format": "chatml"}, "prompt_format"),
])
def test_data_spec_errors(data, message):
    with pytest.raises(ValueError, match=message):
        RunSpec.model_validate({"data": data})


def test_a_conversation_ending_with_the_assistant_carries_its_answer(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                             {"role": "user", "content": "2+2?"},
                                             {"role": "assistant", "content": "4"}]}) + "\n")
    (ex,) = load_examples(path, DataCfg(task="jsonl", train_path=str(path), prompt_format="chat"))
    assert ex.answer == "4" and ex.prompt == "2+2?" and [m["role"] for m in ex.messages] == ["user", "assistant", "user"]
