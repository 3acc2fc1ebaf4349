"""The Tinker API's routes under `/api/v1` (an `HttpApi` of `rlserve.gateway.http`): the requests the `tinker`
SDK 0.38 sends (its `resources/` and `lib/public_interfaces/`), bodies read here (no framework binding) and
handed to the operations (`rlserve.tinker.calls`) through a `TinkerBackend`: in process, or on a cluster the
coordinator, which holds the sessions. The caller is the listener's principal: the SDK sends its key as
`X-API-Key` (a `tml-` key from `deploy/serve users add NAME --tinker`).

Errors: a body that cannot be read, or a call on a missing (or another user's) session, model or sampler,
is a 4xx JSON `{"detail", "field"}` at once; a model's call whose values are wrong gets a future that fails
with the SDK's user category naming the field (it holds the call's seq id, so the calls after it still run
in order).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from rlserve.gateway.http import PRINCIPAL
from rlserve.security.principal import Principal
from rlserve.tinker.futures import UserError

_PROTO = "application/x-protobuf"


@dataclass(frozen=True)
class Reply:
    """An operation's answer (`rlserve.tinker.calls`): JSON, or a protobuf body, or an error naming its field."""

    status: int = 200
    json: Any = None
    proto: bytes | None = None  # a protobuf body (a finished future's result)
    field: str | None = None  # an error's field


class TinkerBackend(Protocol):
    async def call(self, caller: Principal, op: str, *args: Any) -> Reply:
        """Operation `op` of `rlserve.tinker.calls.TinkerCalls` for `caller` (in process, or on the coordinator)."""
        ...


def body_json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError("body", f"not JSON ({err})") from None
    if not isinstance(value, dict):
        raise UserError("body", "must be a JSON object")
    return value
# The client config this server answers: API keys (no JWT exchange), httpx's own transport, zstd-compressed
# forward_backward bodies (the SDK's default), custom losses client-side, sample futures one by one.
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                 "proto_compress_fwdbwd": True, "parallel_fwdbwd_chunks": True, "custom_loss_server_side": False,
                 "sample_use_retrieve_futures": False, "sample_join_sampling_session": False}


class TinkerApi:
    prefix = "/api/v1"
    max_request_bytes = 64 * 2**20
    # The SDK's heartbeat every 10 s: refused for `heartbeat_timeout_s` while its own futures' long polls fill
    # the caller's calls in flight, the session would end under a busy client (the cookbook's rl driver).
    liveness_paths = frozenset({"/session_heartbeat"})

    def __init__(self, backend: TinkerBackend):
        self.backend = backend

    def token(self, request: web.Request) -> str | None:
        return request.headers.get("X-API-Key")

    def error(self, status: int, message: str, field: str | None = None) -> web.Response:
        return web.json_response({"detail": message, "field": field}, status=status)

    def routes(self) -> list[web.RouteDef]:
        post, get = web.post, web.get
        json_ops = {"/create_session": "create_session", "/session_heartbeat": "heartbeat",
                    "/create_model": "create_model", "/get_info": "get_info", "/unload_model": "unload_model",
                    "/optim_step": "optim_step", "/save_weights": "save_weights",
                    "/save_weights_for_sampler": "save_for_sampler", "/load_weights": "load_weights",
                    "/create_sampling_session": "create_sampler", "/asample": "asample",
                    "/retrieve_future": "retrieve_future", "/cancel_future": "cancel_future",
                    "/weights_info": "weights_info"}
        return [
            post("/client/config", self.client_config), post("/client/dynamic_config", self.dynamic_config),
            get("/healthz", self.healthz), post("/telemetry", self.telemetry),
            get("/get_server_capabilities", self._op("capabilities")),
            *(post(path, self._json_op(op)) for path, op in json_ops.items()),
            post("/sessions/{sid}/finish", self._op("finish_session", "sid")),
            post("/forward_backward", self.forward_backward),
            get("/samplers/{sid}", self._op("get_sampler", "sid")),
            get("/training_runs", self._paged("training_runs", 20)),
            get("/training_runs/{run}", self._op("training_run", "run")),
            get("/training_runs/{run}/checkpoints", self._op("checkpoints", "run")),
            get("/checkpoints", self._paged("user_checkpoints", 100)),
            web.delete("/training_runs/{run}/checkpoints/{kind}/{name}",
                       self._op("delete_checkpoint", "run", "kind", "name")),
        ]

    # --- answers the listener gives itself ------------------------------------------------------------

    async def client_config(self, request: web.Request) -> web.Response:
        return web.json_response(CLIENT_CONFIG)

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def telemetry(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})  # the SDK's telemetry is not kept

    # --- operations ---------------------------------------------------------------------------------

    def _respond(self, reply: Reply) -> web.Response:
        if reply.proto is not None:
            return web.Response(body=reply.proto, content_type=_PROTO)
        if reply.status >= 400:
            return self.error(reply.status, reply.json["detail"], reply.field)
        return web.json_response(reply.json)

    async def _call(self, request: web.Request, op: str, *args: Any) -> web.Response:
        return self._respond(await self.backend.call(request[PRINCIPAL], op, *args))

    def _op(self, op: str, *params: str):
        async def handler(request: web.Request) -> web.Response:
            return await self._call(request, op, *(request.match_info[p] for p in params))
        return handler

    def _json_op(self, op: str):
        async def handler(request: web.Request) -> web.Response:
            try:
                body = body_json(await request.read())
            except UserError as err:
                return self.error(400, str(err), err.field)
            return await self._call(request, op, body)
        return handler

    def _paged(self, op: str, default_limit: int):
        async def handler(request: web.Request) -> web.Response:
            try:
                limit, offset = _int(request, "limit", default_limit), _int(request, "offset", 0)
            except UserError as err:
                return self.error(400, str(err), err.field)
            return await self._call(request, op, limit, offset)
        return handler

    async def forward_backward(self, request: web.Request) -> web.Response:
        """`forward_backward` and `forward` alike: the SDK's protobuf says which (`forward_only`); a zstd body the
        listener has undone already (aiohttp, with backports.zstd), or `wire` does."""
        return await self._call(request, "forward_backward", await request.read(),
                                request.headers.get("Content-Encoding"))


def _int(request: web.Request, name: str, default: int) -> int:
    try:
        return max(0, int(request.query.get(name, default)))
    except ValueError:
        raise UserError(name, "must be an integer") from None
