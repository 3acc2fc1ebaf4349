"""OpenAI chat messages -> what the run's chat template renders, and completions -> OpenAI tool calls.

Tools reach the model as `env.args.declare_tools` says (`rlserve.agents.config`): through the chat
template's own `tools=` (assistant tool calls and `tool` messages go to the template as transformers
takes them), or in a system message in the words of the built-in tool_use environment (or not at all,
`none`: a model that learnt the calls from demonstrations), with each
assistant tool call written back in the model family's format (`environments.tools.calls.call_text`)
and tool answers as that format's observation (hermes: a user turn of `<tool_response>` blocks;
llama3: `tool` messages). A completion's calls are parsed with the same parsers (`parse_tool_calls`).

`message_key` is what the continuation check compares (`rlserve.agents.session`): role, text, and tool
calls by name and arguments (their ids are the client's bookkeeping).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from rlserve.agents.config import ExternalAgentArgs
from rlserve.data.prompts import PromptTokenizer
from rlserve.environments.tools.calls import ToolCall, call_text, observation, parse_tool_calls
from rlserve.rpc import invalid_argument
from rlserve.v1 import agents_pb2

Message = dict[str, Any]
_CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)
# What a chat template may raise on messages or tools it cannot render.
RENDER_ERRORS = (TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError)


def to_dicts(messages: Sequence[agents_pb2.AgentMessage]) -> list[Message]:
    """The request's messages in OpenAI's shape (only the keys they set)."""
    out = []
    for m in messages:
        d: Message = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def _arguments(text: str) -> Any:
    """A call's arguments as data when they are JSON (templates render objects), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def message_key(m: Message) -> tuple:
    """What makes two messages the same to the model."""
    calls = tuple((c["function"]["name"], json.dumps(_arguments(c["function"]["arguments"]), sort_keys=True))
                  for c in m.get("tool_calls") or ())
    content = m.get("content") or ""
    return m["role"], content.strip() if m["role"] == "assistant" else content, calls, m.get("name", "")


def tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


def declaration(schemas: list[dict], fmt: str) -> str:
    """The tools in a system message, in the words of the built-in tool_use environment (`declare_tools:
    system`), so a model taught there reads the same thing here."""
    if fmt == "llama3":
        declared = "\n\n".join(json.dumps({"type": "function", "function": s}, indent=4) for s in schemas)
        return ("You may call functions. To call one, respond with only a JSON object of the form "
                '{"name": function name, "parameters": dictionary of argument name and its value}, and read '
                "its answer in the next message. Answer in plain text when you are done.\n\n" + declared)
    declared = "\n".join(json.dumps({"type": "function", "function": s}) for s in schemas)
    return ("You may call tools. The tools are:\n<tools>\n" + declared + "\n</tools>\nTo call one, write\n"
            '<tool_call>\n{"name": <tool name>, "arguments": <arguments as JSON>}\n</tool_call>\n'
            "and read its answer in the next message. Answer without a tool call when you are done.")


class Renderer:
    """One run's way from OpenAI messages to prompt tokens, and from completions to tool calls."""

    def __init__(self, tok: PromptTokenizer, args: ExternalAgentArgs):
        self.tok, self.fmt = tok, args.tool_format
        self.declare = args.declare_tools != "none"
        self.in_template = args.declare_tools == "template" or (
            args.declare_tools == "auto" and tok.prompt_format == "chat" and tok.renders_tools())

    def template_input(self, messages: list[Message], tools: list[dict] | None) -> tuple[list[Message], list | None]:
        """(messages, tools) as the chat template takes them."""
        if self.in_template:
            return [self._for_template(m) for m in messages], tools or None
        out: list[Message] = []
        for m in messages:
            if m["role"] == "tool":
                answer = observation([m.get("content") or ""], self.fmt)[0]
                if self.fmt == "hermes" and out and out[-1].get("_tool_answers"):
                    out[-1]["content"] += "\n" + answer["content"]  # one user turn answers a turn's calls
                else:
                    out.append({**answer, "_tool_answers": True})
                continue
            content = m.get("content") or ""
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [call_text(ToolCall(c["function"]["name"], _dict(_arguments(c["function"]["arguments"]))),
                                   self.fmt) for c in m["tool_calls"]]
                sep = "; " if self.fmt == "llama3" else "\n"
                content = sep.join(([content] if content else []) + calls)
            out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        out = [{k: v for k, v in m.items() if k != "_tool_answers"} for m in out]
        if tools and self.declare:
            said = declaration([t["function"] for t in tools], self.fmt)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + said}
            else:
                out.insert(0, {"role": "system", "content": said})
        return out, None

    @staticmethod
    def _for_template(m: Message) -> Message:
        out: Message = {"role": "system" if m["role"] == "developer" else m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            out["tool_calls"] = [{"id": c.get("id", ""), "type": "function", "function": {
                "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if m.get(key):
                out[key] = m[key]
        return out

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """A conversation rendered whole (the start of an episode's sequence)."""
        rendered, template_tools = self.template_input(messages, tools)
        try:
            return self.tok.episode_prompt_ids(rendered, template_tools)
        except RENDER_ERRORS as err:
            field = "tools" if tools else "messages"
            raise invalid_argument(field, f"the run's chat template cannot render these {field}: "
                                          f"{type(err).__name__}: {str(err)[:300]}") from None

    def continuation_ids(self, messages: list[Message], last_id: int) -> list[int]:
        """The tokens after a completion whose last token was `last_id`: the end of its turn, `messages`
        (new since it) and the next generation prompt, rendered apart from the tokens before them."""
        rendered, _ = self.template_input(messages, None)
        try:
            return self.tok.observation_ids(rendered, last_id)
        except RENDER_ERRORS as err:
            raise invalid_argument("messages", f"the run's chat template cannot append these messages as tokens: "
                                               f"{type(err).__name__}: {str(err)[:300]}") from None

    def tool_calls(self, text: str) -> tuple[str, list[agents_pb2.AgentToolCall]]:
        """(content, calls) of a completion: the calls it makes in the run's tool format, and its text
        without them. A malformed call stays in the content, as the model wrote it."""
        parsed = parse_tool_calls(text, self.fmt)
        if not parsed.calls:
            return text, []
        content = "" if self.fmt == "llama3" and not parsed.errors else _CALL_BLOCK.sub("", text).strip()
        return content, [agents_pb2.AgentToolCall(id=f"call_{secrets.token_hex(12)}", name=c.name,
                                                  arguments=json.dumps(c.arguments)) for c in parsed.calls]


def _dict(arguments: Any) -> dict:
    return arguments if isinstance(arguments, dict) else {"input": arguments}
