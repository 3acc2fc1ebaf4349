"""What the environment service does with a Reset or Step request.

The environment's code runs on the request's decoded episode; whatever it
raises or returns that breaks the contract (not the declared types, a
non-finite reward, state that is not JSON, more than the bounds below) comes
back as `ENVIRONMENT_STATUS_ERROR` with a one-line reason, so one episode's
fault never fails a call, the service, or the run (the run drops that
episode's group and counts it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlserve.environments.interfaces import Environment, Episode, Message, ResetOutput, StepInput, StepOutput
from rlserve.logs import event
from rlserve.rpc import invalid_argument
from rlserve.v1 import environment_pb2 as pb

log = logging.getLogger("rlserve.environment")

# Bounds of what an environment may return in one call.
MAX_MESSAGES = 64
MAX_MESSAGES_CHARS = 256 * 1024  # all contents of one response's messages together
MAX_ROLE_CHARS = 32
MAX_STATE_CHARS = 1024 * 1024
MAX_TOOLS = 64
MAX_TOOLS_CHARS = 64 * 1024  # the tools' schemas as JSON
MAX_METRICS = 64
MAX_METRIC_NAME_CHARS = 64
MAX_REWARD = 1e6


class ContractError(ValueError):
    """The environment returned something the contract does not allow."""


def _json_object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as err:
        raise invalid_argument(field, f"not JSON: {err.msg}") from None
    if not isinstance(value, dict):
        raise invalid_argument(field, "must be a JSON object")
    return value


def messages_from_proto(messages) -> list[Message]:
    return [{"role": m.role, "content": m.content} for m in messages]


def messages_to_proto(messages: list[Message]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def episode_from_proto(ep: pb.Episode) -> Episode:
    return Episode(id=ep.id, prompt=ep.prompt, messages=tuple(messages_from_proto(ep.messages)),
                   answer=ep.reference_answer, metadata=_json_object(ep.metadata_json, "episode.metadata_json"),
                   env_args=_json_object(ep.env_args_json, "episode.env_args_json"))


def checked_messages(value: Any, what: str) -> list[Message]:
    """`value` as a list of {"role", "content"} strings within the bounds, else ContractError."""
    if not isinstance(value, (list, tuple)):
        raise ContractError(f"{what}: a list of messages, not {type(value).__name__}")
    if len(value) > MAX_MESSAGES:
        raise ContractError(f"{what}: {len(value)} messages, at most {MAX_MESSAGES}")
    out, chars = [], 0
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ContractError(f"{what}[{i}]: a message is {{'role': str, 'content': str}}, got {str(m)[:100]!r}")
        if not 0 < len(m["role"]) <= MAX_ROLE_CHARS:
            raise ContractError(f"{what}[{i}].role: 1 to {MAX_ROLE_CHARS} characters")
        chars += len(m["content"])
        out.append({"role": m["role"], "content": m["content"]})
    if chars > MAX_MESSAGES_CHARS:
        raise ContractError(f"{what}: {chars} characters, at most {MAX_MESSAGES_CHARS}")
    return out


def _state_json(state: Any) -> str:
    try:
        text = json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ContractError(f"state: must be JSON data ({err})") from None
    if len(text) > MAX_STATE_CHARS:
        raise ContractError(f"state: {len(text)} characters of JSON, at most {MAX_STATE_CHARS}")
    return text


def _metrics(value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping) or len(value) > MAX_METRICS:
        raise ContractError(f"metrics: a mapping of at most {MAX_METRICS} names to numbers")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not 0 < len(k) <= MAX_METRIC_NAME_CHARS:
            raise ContractError(f"metrics: names are 1 to {MAX_METRIC_NAME_CHARS} characters, got {str(k)[:80]!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ContractError(f"metrics.{k}: a finite number, got {str(v)[:80]!r}")
        out[k] = float(v)
    return out


def tools_json(tools: Any) -> str:
    """Reset's tools as the response's JSON ("" for none), or ContractError naming what is wrong."""
    if tools is None:
        return ""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise ContractError(f"tools: a list of at most {MAX_TOOLS} {{'type': 'function', 'function': {{'name': ...}}}} "
                            f"schemas, got {str(tools)[:120]}")
    text = json.dumps(tools)
    if len(text) > MAX_TOOLS_CHARS:
        raise ContractError(f"tools: {len(text)} characters of JSON, at most {MAX_TOOLS_CHARS}")
    return text


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"[:300]


def reset(env: Environment, version: str, request: pb.ResetRequest) -> pb.ResetResponse:
    episode = episode_from_proto(request.episode)
    try:
        out = env.reset(episode)
        if not isinstance(out, ResetOutput):
            raise ContractError(f"reset returned {type(out).__name__}, not ResetOutput")
        messages = checked_messages(out.messages, "messages")
        if not messages:
            raise ContractError("messages: reset must return at least one message")
        state = _state_json(out.state)
        tools = tools_json(out.tools)
    except Exception as err:  # noqa: BLE001 - the environment's fault is this episode's status
        event(log, "environment.reset_error", logging.WARNING, run=request.run_id or None, episode=episode.id,
              error=_error(err))
        return pb.ResetResponse(status=pb.ENVIRONMENT_STATUS_ERROR, error=_error(err), environment_version=version)
    return pb.ResetResponse(status=pb.ENVIRONMENT_STATUS_OK, messages=messages_to_proto(messages), state_json=state,
                            environment_version=version, tools_json=tools)


def step(env: Environment, version: str, request: pb.StepRequest) -> pb.StepResponse:
    t0 = time.perf_counter()
    episode = episode_from_proto(request.episode)
    try:
        state = json.loads(request.state_json) if request.state_json else None
    except json.JSONDecodeError as err:
        raise invalid_argument("state_json", f"not JSON: {err.msg}") from None
    inp = StepInput(episode=episode, conversation=messages_from_proto(request.conversation),
                    assistant=request.assistant.content, state=state, turn=request.turn)
    try:
        out = env.step(inp)
        if not isinstance(out, StepOutput):
            raise ContractError(f"step returned {type(out).__name__}, not StepOutput")
        if not isinstance(out.done, bool):
            raise ContractError(f"done: a bool, got {type(out.done).__name__}")
        reward = out.reward
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward) \
                or abs(reward) > MAX_REWARD:
            raise ContractError(f"reward: a finite number within +-{MAX_REWARD:g}, got {str(reward)[:80]!r}")
        observation = checked_messages(out.observation, "observation")
        if not out.done and not observation:
            raise ContractError("observation: an episode that goes on needs at least one message")
        metrics = _metrics(out.metrics)
        state_text = _state_json(out.state)
    except Exception as err:  # noqa: BLE001 - the environment's fault is this episode's status
        event(log, "environment.step_error", logging.WARNING, run=request.run_id or None, episode=episode.id,
              turn=request.turn, error=_error(err))
        return pb.StepResponse(status=pb.ENVIRONMENT_STATUS_ERROR, error=_error(err), environment_version=version,
                               compute_seconds=time.perf_counter() - t0)
    return pb.StepResponse(status=pb.ENVIRONMENT_STATUS_OK, observation=messages_to_proto(observation),
                           reward=float(reward), done=out.done, metrics=metrics, state_json=state_text,
                           environment_version=version, compute_seconds=time.perf_counter() - t0)


class EnvironmentThreads:
    """Runs environments' code off the event loop, on threads of its own.

    A plug-in that hangs holds its thread until it returns (a Python thread cannot be stopped); the
    caller's time-out (`env.timeout_s`) ends that episode. The pool is the service's own and large,
    so a few hung episodes leave threads for the others (and for the reward functions, which use
    the default pool).
    """

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rlserve-env")

    async def reset(self, env: Environment, version: str, request: pb.ResetRequest) -> pb.ResetResponse:
        return await asyncio.get_running_loop().run_in_executor(self.pool, reset, env, version, request)

    async def step(self, env: Environment, version: str, request: pb.StepRequest) -> pb.StepResponse:
        return await asyncio.get_running_loop().run_in_executor(self.pool, step, env, version, request)
