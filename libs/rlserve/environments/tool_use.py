"""`tool_use`: the policy may call tools before it answers; its first message without a tool call is
its answer, scored by reward functions (the run's `args.functions`, or the service's default).

The tools are declared to the policy by its own chat template (`declare_tools:
template`: Reset returns their schemas and the template renders them, as
transformers' `tools=`; the preflight refuses a template that renders no tools),
or (`declare_tools: system`, the default) in a system message, in the form the
model family's chat templates render a `tools=` list into, so a template
without tool support works too (or `declare_tools: none`: nothing declares
them, for a model taught the calls by SFT demonstrations whose context cannot
hold the schemas): `tool_format: hermes` (Hermes / Qwen, the default: a `<tools>` block of JSON schemas and the `<tool_call>` format, each
call answered in the next user turn as `<tool_response>` blocks) or `llama3`
(Llama 3.1-3.3: the message is the JSON call with `parameters`, each call
answered by a `tool` message; `tools.calls` parses both). A malformed call, an unknown tool or a tool's error
is an answer too (counted in `malformed_calls` and `tool_errors`), never an
exception. Built-in tools: `calculator` (`tools.calculator`) and `python`
(`tools.sandbox`: no network, no files but its own, limits, not root). A data
row may give its episode fewer of them (`env_args.tools`, a subset of `tools`):
only those are declared and answered. The episode's state counts the calls so far.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rlserve.environments.interfaces import Environment, Episode, ResetOutput, StepInput, StepOutput
from rlserve.environments.tools.calculator import CalculatorError, calculate
from rlserve.environments.tools.calls import FORMATS, ToolCall, observation, parse_tool_calls
from rlserve.environments.tools.sandbox import Limits, SandboxUnavailable, run_python
from rlserve.rewards.interfaces import RewardInput
from rlserve.rewards.loader import CombinedReward

SCHEMAS = {
    "calculator": {"name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and "
                   "parentheses) exactly.", "parameters": {"type": "object", "properties": {
                       "expression": {"type": "string"}}, "required": ["expression"]}},
    "python": {"name": "python", "description": "Run a Python script (standard library only, no network) and "
               "return what it prints.", "parameters": {"type": "object", "properties": {
                   "code": {"type": "string"}}, "required": ["code"]}},
}
MAX_CODE_CHARS = 16_384


def _system_prompt(tools: list[str], fmt: str) -> str:
    if fmt == "llama3":
        declared = "\n\n".join(json.dumps({"type": "function", "function": SCHEMAS[t]}, indent=4) for t in tools)
        return ("You may call functions. To call one, respond with only a JSON object of the form "
                '{"name": function name, "parameters": dictionary of argument name and its value}, and read '
                "its answer in the next message. Answer in plain text when you are done.\n\n" + declared)
    declared = "\n".join(json.dumps({"type": "function", "function": SCHEMAS[t]}) for t in tools)
    return ("You may call tools. The tools are:\n<tools>\n" + declared + "\n</tools>\nTo call one, write\n"
            '<tool_call>\n{"name": <tool name>, "arguments": <arguments as JSON>}\n</tool_call>\n'
            "and read its answer in the next message. Answer without a tool call when you are done.")


class ToolUse(Environment):
    name = "tool_use"

    def __init__(self, reward: CombinedReward, tools: list[str] | None = None, max_output_chars: int = 2000,
                 python_wall_s: float = 10.0, tool_format: str = "hermes", declare_tools: str = "system"):
        tools = ["calculator"] if tools is None else tools
        if not isinstance(tools, list) or not tools or any(t not in SCHEMAS for t in tools):
            raise ValueError(f"tools: a non-empty list of {sorted(SCHEMAS)}, got {tools!r}")
        if tool_format not in FORMATS:
            raise ValueError(f"tool_format: one of {', '.join(FORMATS)}, got {tool_format!r}")
        self.format = tool_format
        if declare_tools not in ("system", "template", "none"):
            raise ValueError(f"declare_tools: system, template or none, got {declare_tools!r}")
        self.declare_tools = declare_tools
        if isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int) \
                or not 16 <= max_output_chars <= 65_536:
            raise ValueError(f"max_output_chars: an integer in 16..65536, got {max_output_chars!r}")
        if isinstance(python_wall_s, bool) or not isinstance(python_wall_s, (int, float)) \
                or not 0 < python_wall_s <= 60:
            raise ValueError(f"python_wall_s: seconds in (0, 60], got {python_wall_s!r}")
        self.reward, self.tools, self.max_output_chars = reward, tools, max_output_chars
        self.limits = Limits(wall_s=float(python_wall_s), cpu_s=max(1, int(python_wall_s)))
        self._run: dict[str, Callable[[dict[str, Any]], str]] = {"calculator": self._calculator,
                                                                   "python": self._python}

    def _tools_of(self, episode: Episode) -> list[str]:
        """The row's `env_args.tools`, else every tool of the spec; a row naming another tool is refused."""
        tools = episode.env_args.get("tools", self.tools)
        if not isinstance(tools, list) or not tools or any(t not in self.tools for t in tools):
            raise ValueError(f"env_args.tools: a non-empty list of the spec's tools {self.tools}, got {tools!r}")
        return tools

    def reset(self, episode: Episode) -> ResetOutput:
        messages, tools = list(episode.messages), self._tools_of(episode)
        if self.declare_tools == "none":
            return ResetOutput(messages, {"calls": 0})
        if self.declare_tools == "template":  # the policy's chat template renders them (its `tools=`)
            return ResetOutput(messages, {"calls": 0}, [{"type": "function", "function": SCHEMAS[t]}
                                                        for t in tools])
        prompt = _system_prompt(tools, self.format)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
        return ResetOutput(messages, {"calls": 0})

    def step(self, step: StepInput) -> StepOutput:
        state = step.state or {"calls": 0}
        parsed = parse_tool_calls(step.assistant, self.format)
        if not parsed.any:
            ep = step.episode
            scored = self.reward(RewardInput(ep.prompt, step.assistant, ep.answer, ep.metadata))
            return StepOutput([], scored.total, True, {**scored.components, **scored.metrics,
                                                       "tool_calls": float(state["calls"]),
                                                       "turns": float(step.turn)}, state)
        answers, errors, tools = [], 0, self._tools_of(step.episode)
        for call in parsed.calls:
            text, ok = self._answer(call, tools)
            answers.append(text)
            errors += not ok
        answers += [f"error: {e}" for e in parsed.errors]
        state = {"calls": state["calls"] + len(parsed.calls)}
        metrics = {"malformed_calls": float(len(parsed.errors)), "tool_errors": float(errors),
                   "tool_calls": float(state["calls"])}
        return StepOutput(observation(answers, self.format), 0.0, False, metrics, state)

    def _answer(self, call: ToolCall, tools: list[str]) -> tuple[str, bool]:
        if call.name not in tools:
            return f"error: unknown tool {call.name[:64]!r}; the tools are {', '.join(tools)}", False
        try:
            text, ok = self._run[call.name](call.arguments), True
        except (CalculatorError, ValueError, SandboxUnavailable) as err:
            text, ok = f"error: {err}", False
        if len(text) > self.max_output_chars:
            text = text[:self.max_output_chars] + "\n[output cut]"
        return text, ok

    @staticmethod
    def _calculator(args: dict[str, Any]) -> str:
        return calculate(args.get("expression", ""))

    def _python(self, args: dict[str, Any]) -> str:
        code = args.get("code")
        if not isinstance(code, str) or not code.strip() or len(code) > MAX_CODE_CHARS:
            raise ValueError(f"`code` must be a non-empty script of at most {MAX_CODE_CHARS} characters")
        result = run_python(code, self.limits)
        if result.timed_out:
            return f"{result.stdout}\nerror: the script ran out of time ({self.limits.wall_s:g} s)".strip()
        if result.exit_code != 0:
            return f"{result.stdout}\n{result.stderr}".strip()
        return result.stdout if result.stdout.strip() else "(no output)"
