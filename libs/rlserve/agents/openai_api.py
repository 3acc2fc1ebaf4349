"""The OpenAI-compatible endpoint on the gateway's HTTP listener (`rlserve.gateway.http`), under `/v1`.

    GET  /v1/models                          the caller's runs (`model` names one)
    GET  /v1/models/{model}
    POST /v1/chat/completions                a chat under the run's current policy (tools, n, stop,
    POST /v1/completions                     max_tokens, temperature, top_p, logprobs, seed, stream)
    GET  /v1/episodes/next?model=RUN[&wait_s=S]   the run's next episode: a data row, its id, its base URL
    POST /v1/episodes                        {"model", "task_id"[, "answer"]}: an episode of the agent's task
    POST /v1/episodes/{id}/reward            {"reward": r} or {} / {"answer": text} (the run's reward
                                             functions score it): ends the episode
    /v1/episodes/{id}/chat/completions, /completions, /models: the same, in that episode (a base URL any
                                             OpenAI client takes); or name it in an `X-Episode-Id` header

The caller's key is `Authorization: Bearer` (the gateway's tokens and per-caller limits apply). Errors
have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with `param` naming the field at
fault; a client's mistake is a 4xx, never a 500. The handlers reach the cluster only through `Backend`,
typed callables the gateway app implements with Serve handles.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, Protocol

import grpc
from aiohttp import web

from rlserve.agents import wire
from rlserve.gateway.http import HTTP_STATUS, PRINCIPAL
from rlserve.rpc import RpcError
from rlserve.security.principal import Principal
from rlserve.v1 import agents_pb2
from rlserve.v1 import coordinator_pb2 as pb

log = logging.getLogger("rlserve.gateway")
PREFIX = "/v1"
EPISODE_HEADER = "X-Episode-Id"
MAX_REQUEST_BYTES = 16 * 1024 * 1024
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$", re.DOTALL)
_RUN_NOT_FOUND = re.compile(r"^run '(.*)'$", re.DOTALL)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}


class Backend(Protocol):
    """The cluster as the endpoint reaches it (each call raises `RpcError` with the service's status)."""

    async def list_runs(self, caller: Principal) -> list[pb.Run]: ...

    async def next_episode(self, req: agents_pb2.NextEpisodeRequest, caller: Principal
                           ) -> agents_pb2.NextEpisodeResponse: ...

    async def start_episode(self, req: agents_pb2.StartEpisodeRequest, caller: Principal
                            ) -> agents_pb2.StartEpisodeResponse: ...

    async def chat(self, req: agents_pb2.ChatRequest, caller: Principal) -> agents_pb2.ChatResponse: ...

    async def end_episode(self, req: agents_pb2.EndEpisodeRequest, caller: Principal
                          ) -> agents_pb2.EndEpisodeResponse: ...


def _model(run: pb.Run) -> dict[str, Any]:
    return {"id": run.run_id, "object": "model", "created": int(run.created_unix), "owned_by": run.owner or "rlserve"}


class OpenAiApi:
    prefix = PREFIX
    max_request_bytes = MAX_REQUEST_BYTES
    liveness_paths: frozenset[str] = frozenset()

    def __init__(self, backend: Backend):
        self.backend = backend

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/models", self.models), web.get("/models/{model}", self.model),
            web.post("/chat/completions", self.chat), web.post("/completions", self.completions),
            web.get("/episodes/next", self.next_episode), web.post("/episodes", self.start_episode),
            web.post("/episodes/{episode}/reward", self.reward),
            web.post("/episodes/{episode}/chat/completions", self.chat),
            web.post("/episodes/{episode}/completions", self.completions),
            web.get("/episodes/{episode}/models", self.models),
            web.get("/episodes/{episode}/models/{model}", self.model),
        ]

    def token(self, request: web.Request) -> str | None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        return (token.strip() or None) if scheme.lower() == "bearer" else None

    def error(self, status: int, message: str, field: str | None = None, code: str | None = None) -> web.Response:
        kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        if code is None and field == "model" and status == 404:
            code = "model_not_found"
        return web.json_response({"error": {"message": message, "type": kind, "param": field, "code": code}},
                                 status=status)

    def _rpc_error(self, err: RpcError) -> web.Response:
        """A service's status in OpenAI's shape: `field: problem` names the param; a run the caller may not
        see reads as OpenAI's missing model, in the words of one that does not exist."""
        status = HTTP_STATUS.get(err.code, 500)
        message, field = err.message, None
        if err.code == grpc.StatusCode.NOT_FOUND and (run := _RUN_NOT_FOUND.match(message)):
            return self.error(404, f"The model '{run.group(1)}' does not exist or you do not have access to it.",
                              "model")
        if (named := _FIELD.match(message)) is not None:
            field, message = named.group(1), named.group(2)
        # OpenAI's code for a conversation past the model's context, which agent loops handle by ending it.
        code = "context_length_exceeded" if err.code == grpc.StatusCode.OUT_OF_RANGE else None
        return self.error(status, message, field, code)

    async def _call(self, fn, req, request: web.Request):
        try:
            return await fn(req, request[PRINCIPAL])
        except RpcError as err:
            raise _Answer(self._rpc_error(err)) from None

    # --- handlers ------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            runs = await self.backend.list_runs(request[PRINCIPAL])
        except RpcError as err:
            return self._rpc_error(err)
        return web.json_response({"object": "list", "data": [_model(r) for r in runs]})

    async def model(self, request: web.Request) -> web.StreamResponse:
        try:
            runs = await self.backend.list_runs(request[PRINCIPAL])
        except RpcError as err:
            return self._rpc_error(err)
        wanted = request.match_info["model"]
        run = next((r for r in runs if r.run_id == wanted), None)
        if run is None:
            return self._rpc_error(RpcError(grpc.StatusCode.NOT_FOUND, f"run {wanted!r}"))
        return web.json_response(_model(run))

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as err:
            raise _Answer(self.error(400, f"the request body is not JSON: {err}")) from None

    def _episode_id(self, request: web.Request) -> str:
        return request.match_info.get("episode") or request.headers.get(EPISODE_HEADER, "")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, wire.chat_request, wire.chat_completion, wire.chat_chunks)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, wire.completion_request, wire.text_completion, wire.completion_chunks)

    async def _generate(self, request: web.Request, parse, whole, chunks) -> web.StreamResponse:
        try:
            body = await self._body(request)
            try:
                req, stream, usage, logprobs = parse(body, self._episode_id(request))
            except wire.WireError as err:
                return self.error(400, err.message, err.field)
            resp = await self._call(self.backend.chat, req, request)
        except _Answer as answer:
            return answer.response
        if not stream:
            return web.json_response(whole(resp, req.run_id, logprobs))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        try:
            for chunk in chunks(resp, req.run_id, logprobs, usage):
                await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except ConnectionResetError:
            pass  # the client went away; the call is captured all the same
        return out

    async def next_episode(self, request: web.Request) -> web.StreamResponse:
        model = request.query.get("model", "")
        try:
            wait_s = float(request.query.get("wait_s", "0"))
        except ValueError:
            return self.error(400, "must be a number of seconds", "wait_s")
        if not math.isfinite(wait_s) or wait_s < 0:
            return self.error(400, "must be a number of seconds >= 0", "wait_s")
        try:
            resp = await self._call(self.backend.next_episode,
                                    agents_pb2.NextEpisodeRequest(run_id=model, wait_s=wait_s), request)
        except _Answer as answer:
            return answer.response
        if not resp.episode_id:
            return web.json_response({"episode_id": None})
        return web.json_response(wire.episode(resp, self._base(request)))

    async def start_episode(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            if not isinstance(body, dict):
                return self.error(400, "the request body must be a JSON object")
            for key in body:
                if key not in ("model", "task_id", "answer"):
                    return self.error(400, f"Unrecognized request argument supplied: {key}", key)
            for key in body:
                if not isinstance(body[key], str):
                    return self.error(400, "must be a string", key)
            resp = await self._call(self.backend.start_episode, agents_pb2.StartEpisodeRequest(
                run_id=body.get("model", ""), task_id=body.get("task_id", ""), answer=body.get("answer", "")), request)
        except _Answer as answer:
            return answer.response
        return web.json_response(wire.episode(resp, self._base(request)))

    async def reward(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request) if await request.read() else {}
            if not isinstance(body, dict):
                return self.error(400, "the request body must be a JSON object")
            req = agents_pb2.EndEpisodeRequest(episode_id=request.match_info["episode"])
            for key, value in body.items():
                if key == "reward":
                    if value is None:
                        continue
                    if isinstance(value, bool) or not isinstance(value, (int, float)):
                        return self.error(400, f"must be a number, got {type(value).__name__}", "reward")
                    if not math.isfinite(value):
                        return self.error(400, f"must be a finite number, got {value}", "reward")
                    req.reward = float(value)
                elif key in ("answer", "model"):
                    if not isinstance(value, str):
                        return self.error(400, "must be a string", key)
                    setattr(req, "answer" if key == "answer" else "run_id", value)
                else:
                    return self.error(400, f"Unrecognized request argument supplied: {key}", key)
            resp = await self._call(self.backend.end_episode, req, request)
        except _Answer as answer:
            return answer.response
        return web.json_response({"episode_id": resp.episode_id, "reward": resp.reward,
                                  "reward_error": resp.reward_error or None, "calls": resp.calls,
                                  "sequences": resp.sequences})

    @staticmethod
    def _base(request: web.Request) -> str:
        return f"{request.scheme}://{request.host}{PREFIX}"


class _Answer(Exception):
    """An answer ready before the handler's end (an error in the API's shape)."""

    def __init__(self, response: web.Response):
        super().__init__(response.status)
        self.response = response
