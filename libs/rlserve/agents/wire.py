"""OpenAI's wire format <-> the Agents RPCs: request bodies checked and turned into `ChatRequest`s, answers
turned into chat completions, text completions and their server-sent-event chunks.

A request is checked the way OpenAI's API checks it, and refused with the field it names
(`WireError.field`, OpenAI's `param`: `messages[2].content`, `tools[0].function.name`): a key OpenAI does
not have ("Unrecognized request argument supplied"), a wrong type, a value out of range, or a known
parameter this endpoint cannot honour (`logit_bias`, `top_logprobs` > 0, penalties, `response_format`
other than text, ...). Nothing is silently ignored that would change what is sampled.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from typing import Any

from rlserve.v1 import agents_pb2, common_pb2

MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_STOP = 4
MAX_N = 16
ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
          common_pb2.FINISH_REASON_ABORT: "stop", common_pb2.FINISH_REASON_UNSPECIFIED: "stop"}


class WireError(ValueError):
    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field, self.message = field, message


# Parameters both endpoints take; each endpoint adds its own.
_COMMON = {"model", "max_tokens", "n", "stop", "stream", "stream_options", "temperature", "top_p", "seed", "user",
           "frequency_penalty", "presence_penalty", "logit_bias", "logprobs"}
CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                       "parallel_tool_calls", "metadata", "store", "response_format", "modalities", "service_tier",
                       "reasoning_effort", "functions", "function_call", "audio", "prediction",
                       "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier"}
COMPLETION_KEYS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
# Known parameters this endpoint takes only at their "off" value.
_OFF = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "echo": (False,),
        "suffix": ("",), "best_of": (1,), "store": (False,), "functions": ([],), "function_call": ("none",),
        "audio": (), "prediction": (), "web_search_options": (), "reasoning_effort": (), "verbosity": ()}


def _typed(value: Any, kind: type | tuple[type, ...], field: str, what: str) -> Any:
    if isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise WireError(field, f"must be {what}, got {json.dumps(value)}")
    if not isinstance(value, kind):
        raise WireError(field, f"must be {what}, got {type(value).__name__}")
    return value


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    _typed(value, (int, float), key, "a number")
    if not (math.isfinite(value) and lo <= value <= hi):
        raise WireError(key, f"must be between {lo:g} and {hi:g}, got {value}")
    return float(value)


def _integer(body: dict, key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    _typed(value, int, key, "an integer")
    if not lo <= value <= hi:
        raise WireError(key, f"must be between {lo} and {hi}, got {value}")
    return value


def _common(body: dict, allowed: set[str], req: agents_pb2.ChatRequest) -> None:
    """What both endpoints check alike, into `req`."""
    for key in body:
        if key not in allowed:
            raise WireError(key, f"Unrecognized request argument supplied: {key}")
    for key, values in _OFF.items():
        if key in body and body[key] is not None and body[key] not in values:
            raise WireError(key, "is not supported by this endpoint" + (
                f" (only {json.dumps(values[0])})" if values else ""))
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise WireError("model", "required: the id of one of your runs")
    req.run_id = model
    if (n := _integer(body, "n", 1, MAX_N)) is not None:
        req.n = n
    if (t := _number(body, "temperature", 0, 2)) is not None:
        req.temperature = t
    if (p := _number(body, "top_p", 0, 1)) is not None:
        if p == 0:
            raise WireError("top_p", "must be above 0")
        req.top_p = p
    if (seed := _integer(body, "seed", -2**63, 2**63 - 1)) is not None:
        req.seed = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
            raise WireError("stop", f"a non-empty string or a list of at most {MAX_STOP} of them")
        req.stop.extend(stops)
    for key in ("stream",):
        if body.get(key) is not None:
            _typed(body[key], bool, key, "a boolean")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise WireError("stream_options", 'only {"include_usage": true|false}')
        if not body.get("stream"):
            raise WireError("stream_options", "is only allowed when stream is true")
    if body.get("user") is not None:
        _typed(body["user"], str, "user", "a string")


def _content(value: Any, field: str, optional: bool) -> str:
    """A message's text: a string, or a list of text parts."""
    if value is None:
        if optional:
            return ""
        raise WireError(field, "required")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise WireError(f"{field}[{i}]", 'only text parts ({"type": "text", "text": ...}) are supported')
            parts.append(part["text"])
        return "".join(parts)
    raise WireError(field, f"must be a string or a list of text parts, got {type(value).__name__}")


def _tool_calls(value: Any, field: str) -> list[agents_pb2.AgentToolCall]:
    if not isinstance(value, list):
        raise WireError(field, "must be a list")
    calls = []
    for i, call in enumerate(value):
        at = f"{field}[{i}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise WireError(at, 'must be {"id": ..., "type": "function", "function": {"name", "arguments"}}')
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise WireError(f"{at}.function.name", "required")
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):
            raise WireError(f"{at}.function.arguments", "must be a string (JSON text)")
        calls.append(agents_pb2.AgentToolCall(id=str(call.get("id") or ""), name=fn["name"], arguments=arguments))
    return calls


_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "annotations", "audio",
                 "function_call", "reasoning_content"}


def messages(value: Any) -> list[agents_pb2.AgentMessage]:
    if not isinstance(value, list) or not value:
        raise WireError("messages", "required: a non-empty list of messages")
    if len(value) > MAX_MESSAGES:
        raise WireError("messages", f"at most {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise WireError(at, "must be an object with a role and content")
        for key, v in m.items():
            if key not in _MESSAGE_KEYS:
                raise WireError(f"{at}.{key}", f"Unrecognized message field: {key}")
            if key in ("refusal", "annotations", "audio", "function_call", "reasoning_content") and v:
                raise WireError(f"{at}.{key}", "is not supported by this endpoint")
        role = m.get("role")
        if role not in ROLES:
            raise WireError(f"{at}.role", f"must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}")
        msg = agents_pb2.AgentMessage(role=role)
        calls = m.get("tool_calls")
        msg.content = _content(m.get("content"), f"{at}.content", optional=role == "assistant")
        if calls:
            if role != "assistant":
                raise WireError(f"{at}.tool_calls", "only an assistant message has tool calls")
            msg.tool_calls.extend(_tool_calls(calls, f"{at}.tool_calls"))
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise WireError(f"{at}.tool_call_id", "required in a tool message")
            msg.tool_call_id = m["tool_call_id"]
        elif m.get("tool_call_id") is not None:
            raise WireError(f"{at}.tool_call_id", "only a tool message answers a call")
        if m.get("name") is not None:
            msg.name = _typed(m["name"], str, f"{at}.name", "a string")
        out.append(msg)
    return out


def tools(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise WireError("tools", "must be a list")
    if len(value) > MAX_TOOLS:
        raise WireError("tools", f"at most {MAX_TOOLS} tools")
    out = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise WireError(f"{at}.type", 'must be "function"')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise WireError(f"{at}.function", "required: an object with name, description, parameters")
        for key in fn:
            if key not in ("name", "description", "parameters", "strict"):
                raise WireError(f"{at}.function.{key}", f"Unrecognized function field: {key}")
        if not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(fn["name"]):
            raise WireError(f"{at}.function.name", "1-64 letters, digits, '_' or '-'")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise WireError(f"{at}.function.description", "must be a string")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise WireError(f"{at}.function.parameters", 'must be a JSON Schema object ({"type": "object", ...})')
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if k != "strict"}})
    return out


def chat_request(body: Any, episode_id: str) -> tuple[agents_pb2.ChatRequest, bool, bool, bool]:
    """(the request, stream, include_usage, logprobs) of a chat completions body."""
    if not isinstance(body, dict):
        raise WireError(None, "the request body must be a JSON object")
    req = agents_pb2.ChatRequest(episode_id=episode_id)
    _common(body, CHAT_KEYS, req)
    req.messages.extend(messages(body.get("messages")))
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if limit is not None:
        req.max_tokens = _integer({key: limit}, key, 1, 2**31 - 1)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        _typed(logprobs, bool, "logprobs", "a boolean")
    if (top := _integer(body, "top_logprobs", 0, 20)) and top > 0:
        raise WireError("top_logprobs", "only the sampled token's logprob is available (top_logprobs: 0)")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise WireError("response_format", 'only {"type": "text"} is supported')
    if body.get("modalities") not in (None, ["text"]):
        raise WireError("modalities", 'only ["text"]')
    if body.get("tools") is not None:
        listed = tools(body["tools"])
        if listed:
            req.tools_json = json.dumps(listed)
    choice = body.get("tool_choice")
    if choice is not None:
        if choice not in ("none", "auto"):
            raise WireError("tool_choice", '"auto" or "none" (the model decides whether it calls a tool)')
        req.tools_off = choice == "none"
    if body.get("parallel_tool_calls") is not None:
        _typed(body["parallel_tool_calls"], bool, "parallel_tool_calls", "a boolean")
    if body.get("metadata") is not None:
        _typed(body["metadata"], dict, "metadata", "an object")
    stream = bool(body.get("stream"))
    req.token_texts = bool(logprobs) or stream
    return req, stream, bool((body.get("stream_options") or {}).get("include_usage")), bool(logprobs)


def completion_request(body: Any, episode_id: str) -> tuple[agents_pb2.ChatRequest, bool, bool, bool]:
    """(the request, stream, include_usage, logprobs) of a completions body."""
    if not isinstance(body, dict):
        raise WireError(None, "the request body must be a JSON object")
    req = agents_pb2.ChatRequest(episode_id=episode_id, plain=True)
    _common(body, COMPLETION_KEYS, req)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < 2**31 for t in prompt):
            raise WireError("prompt", "token ids must be in 0..2**31-1")
        req.prompt_token_ids.extend(prompt)
    else:
        raise WireError("prompt", "one prompt per call: a string or a list of token ids")
    if (limit := _integer(body, "max_tokens", 1, 2**31 - 1)) is not None:
        req.max_tokens = limit
    logprobs = _integer(body, "logprobs", 0, 5)
    if logprobs:
        raise WireError("logprobs", "only the sampled token's logprob is available (logprobs: 0)")
    stream = bool(body.get("stream"))
    req.token_texts = logprobs is not None or stream
    return req, stream, bool((body.get("stream_options") or {}).get("include_usage")), logprobs is not None


# --- answers ---------------------------------------------------------------------------------------


def _finish(choice: agents_pb2.ChatChoice) -> str:
    return "tool_calls" if choice.tool_calls else FINISH[choice.finish_reason]


def _usage(resp: agents_pb2.ChatResponse) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in resp.choices)
    return {"prompt_tokens": resp.prompt_tokens, "completion_tokens": completion,
            "total_tokens": resp.prompt_tokens + completion}


def _calls(choice: agents_pb2.ChatChoice) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in choice.tool_calls]


def _chat_logprobs(texts: list[str], logprobs: list[float]) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(texts, logprobs)], "refusal": None}


def _meta(resp: agents_pb2.ChatResponse) -> dict[str, Any]:
    """rlserve's own fields beside OpenAI's (clients keep them as extras): the episode and the weights."""
    return {"episode_id": resp.episode_id, "weight_version": resp.weight_version}


def chat_completion(resp: agents_pb2.ChatResponse, model: str, logprobs: bool) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(resp.choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.content or (None if c.tool_calls else ""),
                                   "refusal": None}
        if c.tool_calls:
            message["tool_calls"] = _calls(c)
        choices.append({"index": i, "message": message, "finish_reason": _finish(c),
                        "logprobs": _chat_logprobs(list(c.token_texts), list(c.logprobs)) if logprobs else None})
    return {"id": f"chatcmpl-{resp.call_id}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": f"rlserve-v{resp.weight_version}", "choices": choices,
            "usage": _usage(resp), **_meta(resp)}


def text_completion(resp: agents_pb2.ChatResponse, model: str, logprobs: bool) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(resp.choices):
        lps = None
        if logprobs:
            offsets, at = [], 0
            for t in c.token_texts:
                offsets.append(at)
                at += len(t)
            lps = {"tokens": list(c.token_texts), "token_logprobs": list(c.logprobs), "top_logprobs": None,
                   "text_offset": offsets}
        choices.append({"index": i, "text": c.text, "finish_reason": FINISH[c.finish_reason], "logprobs": lps})
    return {"id": f"cmpl-{resp.call_id}", "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": f"rlserve-v{resp.weight_version}", "choices": choices, "usage": _usage(resp),
            **_meta(resp)}


def _pieces(choice: agents_pb2.ChatChoice) -> list[tuple[str, list[float], list[str]]]:
    """A completion's content in stream deltas (text, its tokens' logprobs and texts): token by token when
    the tokens spell the content, else the content at once with every logprob."""
    texts = list(choice.token_texts)
    if not choice.tool_calls and "".join(texts) == choice.content:
        return [(t, [lp], [t]) for t, lp in zip(texts, choice.logprobs)]
    return [(choice.content, list(choice.logprobs), texts)] if choice.content or texts else []


def chat_chunks(resp: agents_pb2.ChatResponse, model: str, logprobs: bool, usage: bool) -> Iterator[dict[str, Any]]:
    """The completion as `chat.completion.chunk`s: the role, the content's deltas, the tool calls, the finish
    (and the usage). The engine generates a call whole; the stream hands it out in token-sized deltas."""
    base = {"id": f"chatcmpl-{resp.call_id}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "system_fingerprint": f"rlserve-v{resp.weight_version}", **_meta(resp)}
    for i, c in enumerate(resp.choices):
        yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]}
        for text, lps, texts in _pieces(c):
            yield {**base, "choices": [{"index": i, "delta": {"content": text}, "finish_reason": None,
                                        "logprobs": _chat_logprobs(texts, lps) if logprobs else None}]}
        if c.tool_calls:
            yield {**base, "choices": [{"index": i, "delta": {"tool_calls": [
                {"index": k, **call} for k, call in enumerate(_calls(c))]}, "logprobs": None, "finish_reason": None}]}
        yield {**base, "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": _finish(c)}]}
    if usage:
        yield {**base, "choices": [], "usage": _usage(resp)}


def completion_chunks(resp: agents_pb2.ChatResponse, model: str, logprobs: bool, usage: bool
                      ) -> Iterator[dict[str, Any]]:
    base = {"id": f"cmpl-{resp.call_id}", "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": f"rlserve-v{resp.weight_version}", **_meta(resp)}
    for i, c in enumerate(resp.choices):
        for t, lp in zip(c.token_texts, c.logprobs):
            yield {**base, "choices": [{"index": i, "text": t, "finish_reason": None, "logprobs": {
                "tokens": [t], "token_logprobs": [lp], "top_logprobs": None, "text_offset": [0]} if logprobs else None}]}
        yield {**base, "choices": [{"index": i, "text": "", "finish_reason": FINISH[c.finish_reason], "logprobs": None}]}
    if usage:
        yield {**base, "choices": [], "usage": _usage(resp)}


def episode(resp: agents_pb2.NextEpisodeResponse | agents_pb2.StartEpisodeResponse, base: str) -> dict[str, Any]:
    """An episode to play, with the base URL an OpenAI client takes for it."""
    out: dict[str, Any] = {"episode_id": resp.episode_id, "base_url": f"{base}/episodes/{resp.episode_id}",
                           "timeout_s": resp.timeout_s}
    if isinstance(resp, agents_pb2.NextEpisodeResponse):
        out.update(task_id=resp.task_id, validation=resp.validation, prompt=resp.prompt,
                   messages=[{"role": m.role, "content": m.content} for m in resp.messages], answer=resp.answer,
                   metadata=json.loads(resp.metadata_json or "{}"), env_args=json.loads(resp.env_args_json or "{}"))
    return out
