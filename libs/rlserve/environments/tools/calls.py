"""Tool calls in the two formats chat models are trained on, and the tools' answers as they expect them.

`hermes` (Hermes, Qwen 2.5/3): calls are blocks anywhere in the message,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

answered by a user turn of `<tool_response>` blocks (how those templates render a `tool` message).

`llama3` (Llama 3.1-3.3 JSON tool calling): the whole message is the call, a JSON object with
`parameters` (optionally after `<|python_tag|>`; several calls separated by `;`),

    {"name": "calculator", "parameters": {"expression": "12 * 34"}}

answered by one `tool` message per call (the Llama 3 templates render it as an `ipython` turn). A
message that is not JSON is the answer.

A malformed call is not an exception: it becomes an error response the policy reads, and a metric.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_CALLS_PER_TURN = 4
FORMATS = ("hermes", "llama3")
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedCalls:
    calls: list[ToolCall]
    errors: list[str]  # one per malformed call, in the words the policy will read

    @property
    def any(self) -> bool:
        return bool(self.calls or self.errors)


def parse_tool_calls(text: str, fmt: str = "hermes") -> ParsedCalls:
    """The calls of an assistant message in format `fmt` (at most MAX_CALLS_PER_TURN; the rest are errors)."""
    if fmt == "llama3":
        return _parse_llama3(text)
    blocks, errors = [], []
    if "<tool_call>" in text and not _CALL.search(text):
        errors.append("a <tool_call> without its closing </tool_call>")
    for block in _CALL.findall(text):
        try:
            blocks.append(json.loads(block))
        except json.JSONDecodeError as err:
            blocks.append(ValueError(f"tool call is not JSON: {err.msg}"))
    return _calls(blocks, "arguments", errors)


def _parse_llama3(text: str) -> ParsedCalls:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not tagged and not body.startswith("{"):
        return ParsedCalls([], [])  # plain text: the answer
    # One JSON object, or several joined by `;`.
    decoder, objects, errors, pos = json.JSONDecoder(), [], [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as err:
            errors.append(f"tool call is not JSON: {err.msg}")
            break
        objects.append(obj)
        rest = body[pos:].lstrip()
        if rest and not rest.startswith(";"):
            errors.append("text after a tool call; separate several calls with ';'")
            break
        pos = len(body) - len(rest.removeprefix(";").lstrip())
    return _calls(objects, "parameters", errors)


def _calls(decoded: list[Any], args_key: str, errors: list[str]) -> ParsedCalls:
    calls = []
    for i, data in enumerate(decoded):
        if i >= MAX_CALLS_PER_TURN:
            errors.append(f"more than {MAX_CALLS_PER_TURN} tool calls in one turn")
            break
        if isinstance(data, ValueError):
            errors.append(str(data))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            errors.append(f'tool call needs {{"name": ..., "{args_key}": {{...}}}}')
            continue
        args = data.get(args_key, data.get("arguments", {}))
        if not isinstance(args, dict):
            errors.append(f"tool call {args_key} must be an object")
            continue
        calls.append(ToolCall(data["name"], args))
    return ParsedCalls(calls, errors)


def call_text(call: ToolCall, fmt: str) -> str:
    """A call as the model family writes it, which `parse_tool_calls` reads back (for demonstrations)."""
    if fmt == "llama3":
        return json.dumps({"name": call.name, "parameters": call.arguments})
    return f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n</tool_call>"


def tool_response(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def observation(answers: list[str], fmt: str) -> list[dict[str, str]]:
    """The messages that answer a turn's calls (`answers`: each call's output or error, in order)."""
    if fmt == "llama3":
        return [{"role": "tool", "content": a} for a in answers]
    return [{"role": "user", "content": "\n".join(tool_response(a) for a in answers)}]
