"""A calculator agent written against the `openai` client only, which rlserve trains.

It plays the episodes of an `env.name: external_agent` run (examples/agents/grpo_calculator_agent.yaml):
takes a task from the run (`GET /v1/episodes/next`), calls the model with a `calculator` tool, answers
each tool call, and ends the episode with its reward (1 for the right product). rlserve captured every
call's tokens, so the run trains on exactly what the model generated; the agent knows nothing of RL.

    deploy/serve up examples/cluster_chat.yaml
    rlserve submit examples/agents/grpo_calculator_agent.yaml             # prints the run id
    python examples/agents/calculator_agent.py RUN_ID [--agents 8] [--url http://127.0.0.1:9001/v1]

The key is the cluster's user token (`deploy/serve token` prints its file), or `--key`. The agents stop when
the run ends; its held-out accuracy (`val/reward`, episodes the run hands out and never trains on) is in
`rlserve runs get RUN_ID` and the run's reward_curve.png.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import threading
from pathlib import Path

from openai import BadRequestError, OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * and parentheses) exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only integers, + - * and parentheses")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"error: {err}"


def arguments(call) -> dict:
    try:
        args = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return {}
    return args if isinstance(args, dict) else {}


def play(client: OpenAI, model: str, max_calls: int = 3) -> bool:
    """One episode; False once the run has ended."""
    try:
        ep = client.get("/episodes/next", cast_to=object, options={"params": {"model": model, "wait_s": 10}})
    except BadRequestError:  # the run has ended
        return False
    if ep["episode_id"] is None:
        return True
    agent = client.with_options(base_url=ep["base_url"])
    messages = list(ep["messages"])
    message = None
    for _ in range(max_calls):
        try:
            message = agent.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        except BadRequestError as err:
            if err.code == "context_length_exceeded":
                break  # the conversation outgrew the run's context: the episode ends unanswered
            print(f"agent: {err.message}")  # the run has ended, or refuses this episode
            return False
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(str(arguments(call).get("expression", "")))})
    reward = float(message is not None and not message.tool_calls and (message.content or "").strip() == ep["answer"])
    client.post(f"/episodes/{ep['episode_id']}/reward", cast_to=object, body={"reward": reward})
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the run's id")
    parser.add_argument("--url", default=os.environ.get("RLSERVE_OPENAI_URL", "http://127.0.0.1:9001/v1"))
    parser.add_argument("--key", default=os.environ.get("RLSERVE_TOKEN"))
    parser.add_argument("--key-file", type=Path, default=Path("runs/.cluster/token"))
    parser.add_argument("--agents", type=int, default=8, help="episodes played at once")
    args = parser.parse_args()
    key = args.key or args.key_file.read_text().split()[0]
    client = OpenAI(base_url=args.url, api_key=key, timeout=600)

    def agent() -> None:
        while play(client, args.model):
            pass

    threads = [threading.Thread(target=agent) for _ in range(args.agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"run {args.model} has ended")


if __name__ == "__main__":
    main()
