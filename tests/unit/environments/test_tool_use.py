"""Tool calls: the Hermes and Llama 3 formats parsed without exceptions on malformed input, the calculator
without `eval`, and the `tool_use` environment answering calls turn by turn until the policy answers."""

from __future__ import annotations

import json

import pytest

from rlserve.environments.config import EnvironmentCfg
from rlserve.environments.interfaces import Episode, StepInput
from rlserve.environments.loader import load_environment
from rlserve.environments.tools.calculator import CalculatorError, calculate
from rlserve.environments.tools.calls import ToolCall, call_text, parse_tool_calls
from rlserve.environments.tools.sandbox import SandboxUnavailable, run_python
from rlserve.rewards.loader import CombinedReward

EPISODE = Episode("0", "What is 1234 * 5678?", ({"role": "user", "content": "What is 1234 * 5678?"},), "7006652")


@pytest.mark.parametrize("expr, value", [("1234 * 5678", "7006652"), ("(2 + 3) ** 2 - 1", "24"), ("7 / 2", "3.5"),
                                         ("-8 // 3", "-3"), ("10 % 4", "2"), ("1e3 / 10", "100")])
def test_the_calculator_evaluates_arithmetic_exactly(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr, words", [
    ("__import__('os').system('id')", "only numbers"), ("x + 1", "only numbers"), ("2 ** 10000", "exponent"),
    ("1 / 0", "division by zero"), ("9" * 70, "digits"), ("1 +", "cannot parse"), ("", "give an"),
    ("1" * 300, "longer than"), ("(10 ** 60) * (10 ** 60)", "digits"), ("2.0 ** 65", "exponent"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expr, words):
    with pytest.raises(CalculatorError, match=words):
        calculate(expr)


def test_tool_calls_are_parsed_and_malformed_ones_become_errors():
    ok = parse_tool_calls('Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}'
                          '\n</tool_call>')
    assert [(c.name, c.arguments) for c in ok.calls] == [("calculator", {"expression": "2+2"})] and not ok.errors
    bad = parse_tool_calls('<tool_call>{"name": calc}</tool_call><tool_call>[1]</tool_call>'
                           '<tool_call>{"name": "calculator", "arguments": "2+2"}</tool_call>')
    assert not bad.calls and len(bad.errors) == 3
    assert parse_tool_calls("<tool_call>{").errors == ["a <tool_call> without its closing </tool_call>"]
    assert not parse_tool_calls("The answer is 4.").any


@pytest.mark.parametrize("text, calls, errors", [
    ('{"name": "calculator", "parameters": {"expression": "2+2"}}', [("calculator", {"expression": "2+2"})], 0),
    ('<|python_tag|>{"name": "calculator", "parameters": {"expression": "3*3"}}',
     [("calculator", {"expression": "3*3"})], 0),
    ('{"name": "calculator", "arguments": {"expression": "1"}}', [("calculator", {"expression": "1"})], 0),
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "};{"}}', [("a", {}), ("b", {"x": "};{"})], 0),
    ('{"name": "calculator", "parameters": "2+2"}', [], 1), ('{"name": calc}', [], 1), ("<|python_tag|>print(1)", [], 1),
    ("The answer is 4.", [], 0), ("4", [], 0)])
def test_llama3_json_tool_calls_are_parsed_and_malformed_ones_become_errors(text, calls, errors):
    parsed = parse_tool_calls(text, "llama3")
    assert [(c.name, c.arguments) for c in parsed.calls] == calls and len(parsed.errors) == errors


def test_an_episode_in_the_llama3_format_answers_each_call_with_a_tool_message():
    env = environment(tool_format="llama3")
    start = env.reset(EPISODE)
    assert '"parameters"' in start.messages[0]["content"] and "<tool_call>" not in start.messages[0]["content"]
    call = '{"name": "calculator", "parameters": {"expression": "1234 * 5678"}}; {"name": "python", "parameters": {}}'
    first = env.step(StepInput(EPISODE, start.messages, call, start.state, 1))
    assert first.observation == [{"role": "tool", "content": "7006652"},
                                 {"role": "tool", "content": "error: unknown tool 'python'; the tools are calculator"}]
    last = env.step(StepInput(EPISODE, [], "7006652", first.state, 2))
    assert last.done and last.reward == 1.0


def environment(**args):
    cfg = EnvironmentCfg(name="tool_use", args={"functions": [{"name": "exact_match"}], **args})
    return load_environment(cfg, default_reward=lambda: CombinedReward([]))


def test_an_episode_calls_the_calculator_then_answers_and_is_scored():
    env = environment()
    start = env.reset(EPISODE)
    assert start.messages[0]["role"] == "system" and '"name": "calculator"' in start.messages[0]["content"]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>'
    first = env.step(StepInput(EPISODE, start.messages, call, start.state, 1))
    assert not first.done and first.reward == 0
    assert first.observation == [{"role": "user", "content": "<tool_response>\n7006652\n</tool_response>"}]
    assert first.metrics == {"malformed_calls": 0.0, "tool_errors": 0.0, "tool_calls": 1.0}
    conv = start.messages + [{"role": "assistant", "content": call}] + first.observation
    last = env.step(StepInput(EPISODE, conv, "7006652", first.state, 2))
    assert last.done and last.reward == 1.0 and last.metrics["tool_calls"] == 1.0


def test_unknown_tools_bad_arguments_and_malformed_calls_are_answers_not_exceptions():
    env = environment()
    text = ('<tool_call>{"name": "shell", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "open(1)"}}</tool_call>'
            '<tool_call>not json</tool_call>')
    out = env.step(StepInput(EPISODE, [], text, None, 1))
    assert not out.done and out.metrics == {"malformed_calls": 1.0, "tool_errors": 2.0, "tool_calls": 2.0}
    body = out.observation[0]["content"]
    assert body.count("<tool_response>") == 3 and "unknown tool 'shell'" in body and "only numbers" in body


@pytest.mark.parametrize("args, words", [({"tools": ["shell"]}, "tools"), ({"tools": []}, "tools"),
                                         ({"max_output_chars": 1}, "max_output_chars"), ({"colour": 1}, "takes only"),
                                         ({"tool_format": "mistral"}, "tool_format")])
def test_bad_environment_args_name_the_arg(args, words):
    with pytest.raises(ValueError, match=words):
        environment(**args)


def test_the_python_tool_runs_in_the_sandbox():
    try:
        run_python("pass")
    except SandboxUnavailable as err:
        pytest.skip(f"this host cannot build the sandbox: {err}")
    env = environment(tools=["python"], max_output_chars=64)
    call = '<tool_call>{"name": "python", "arguments": {"code": "import os\\nprint(os.listdir(\\"/\\"))\\nprint(\\"x\\" * 500)"}}</tool_call>'
    body = env.step(StepInput(EPISODE, [], call, None, 1)).observation[0]["content"]
    assert "'work'" in body and "[output cut]" in body and "home" not in body


def test_declared_to_the_template_the_tools_come_back_as_schemas_and_no_system_message():
    env = environment(declare_tools="template", tools=["calculator", "python"])
    start = env.reset(EPISODE)
    assert all(m["role"] != "system" for m in start.messages)
    assert [t["function"]["name"] for t in start.tools] == ["calculator", "python"]
    assert all(t["type"] == "function" and "parameters" in t["function"] for t in start.tools)
    with pytest.raises(ValueError, match="declare_tools"):
        environment(declare_tools="prompt")


def test_a_row_gives_its_episode_fewer_tools_and_only_those_are_declared_and_answered():
    env = environment(declare_tools="template", tools=["calculator", "python"])
    row = Episode("1", EPISODE.prompt, EPISODE.messages, EPISODE.answer, env_args={"tools": ["calculator"]})
    assert [t["function"]["name"] for t in env.reset(row).tools] == ["calculator"]
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    out = env.step(StepInput(row, [], call, None, 1))
    assert "unknown tool 'python'; the tools are calculator" in out.observation[0]["content"]
    assert out.metrics["tool_errors"] == 1.0
    system = environment(tools=["calculator", "python"]).reset(row).messages[0]["content"]
    assert '"name": "calculator"' in system and '"name": "python"' not in system
    for tools in (["shell"], [], "calculator"):  # a row may not add tools the spec did not give
        with pytest.raises(ValueError, match=r"env_args\.tools"):
            env.reset(Episode("2", EPISODE.prompt, EPISODE.messages, EPISODE.answer, env_args={"tools": tools}))


def test_declared_by_nothing_the_rows_messages_are_the_prompt():
    """`none`: a model taught the calls by SFT demonstrations, whose context has no room for the schemas."""
    start = environment(declare_tools="none").reset(EPISODE)
    assert start.messages == list(EPISODE.messages) and start.tools is None


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_a_call_written_for_a_demonstration_parses_back(fmt):
    call = ToolCall("calculator", {"expression": "123*45"})
    assert parse_tool_calls(call_text(call, fmt), fmt).calls == [call]


@pytest.mark.parametrize("tools, words", [
    ([{"type": "function", "function": {"name": "calculator"}}], None),
    (None, None),
    ([{"name": "calculator"}], "schemas"),
    ([{"type": "function", "function": {"name": "x", "description": "y" * 70_000}}], "at most"),
])
def test_reset_tools_are_checked_before_they_leave_the_environment_service(tools, words):
    from rlserve.environments.serving import ContractError, tools_json

    if words is None:
        assert tools_json(tools) == ("" if tools is None else json.dumps(tools))
    else:
        with pytest.raises(ContractError, match=words):
            tools_json(tools)
