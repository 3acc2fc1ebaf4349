"""Tool calls in the Hermes / Qwen format the chat templates of those models render and expect:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

and the tools' answers as the observation, a user turn of `<tool_response>` blocks (how those
templates render a `tool` message). A malformed call is not an exception: it becomes an error
response the policy reads, and a metric.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_CALLS_PER_TURN = 4


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


def parse_tool_calls(text: str) -> ParsedCalls:
    """Every `<tool_call>` block of an assistant message (at most MAX_CALLS_PER_TURN; the rest are errors)."""
    calls, errors = [], []
    blocks = _CALL.findall(text)
    if "<tool_call>" in text and not blocks:
        errors.append("a <tool_call> without its closing </tool_call>")
    for i, block in enumerate(blocks):
        if i >= MAX_CALLS_PER_TURN:
            errors.append(f"more than {MAX_CALLS_PER_TURN} tool calls in one turn")
            break
        try:
            data = json.loads(block)
        except json.JSONDecodeError as err:
            errors.append(f"tool call is not JSON: {err.msg}")
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            errors.append('tool call needs {"name": ..., "arguments": {...}}')
            continue
        args = data.get("arguments", {})
        if not isinstance(args, dict):
            errors.append("tool call arguments must be an object")
            continue
        calls.append(ToolCall(data["name"], args))
    return ParsedCalls(calls, errors)


def tool_response(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"
