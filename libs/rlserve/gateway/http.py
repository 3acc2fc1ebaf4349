"""The gateway's HTTP listener: the public APIs that clients of other ecosystems speak over HTTP.

One aiohttp server in the gateway's replica, beside its gRPC server, on the cluster file's
`host:http_port` (loopback by default), with the same tokens, per-caller limits and TLS. Each API
(`HttpApi`: the OpenAI-compatible endpoint under `/v1`, Tinker's under `/api/v1`) is mounted under its
own prefix and answers in its own error shape, because each API's official client parses only its own.

Before a handler runs, the listener has:
- resolved the caller: the API reads its token from the request (`HttpApi.token`, e.g. `Authorization:
  Bearer`) and the token store turns it into a `Principal`; no valid token is 401 in the API's shape;
- taken a slot of the caller's limits (`rlserve.tenancy.callers`): 429 when over, named like the gRPC
  endpoint's RESOURCE_EXHAUSTED; a liveness route (`HttpApi.liveness_paths`) takes only a token of the rate;
- bounded the body at the API's `max_request_bytes`, unread past it (413).
A handler reaches the caller as `request[PRINCIPAL]`. An `RpcError` a handler raises becomes the HTTP
status of its gRPC code with its message (INVALID_ARGUMENT 400, NOT_FOUND 404, ...); anything else is
one clean 500 line, logged, never a traceback in the answer.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from aiohttp import web

from rlserve.logs import event
from rlserve.rpc import RpcError, clean
from rlserve.security.identity import TokenStore
from rlserve.security.principal import SYSTEM, Principal
from rlserve.tenancy.callers import Limiter
from rlserve.tenancy.policy import CallerLimits, OverLimit

log = logging.getLogger("rlserve.gateway")
# Where a handler finds the caller.
PRINCIPAL = web.RequestKey("principal", Principal)

# gRPC status -> HTTP status, for what a handler (or a service it forwards to) raises.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class HttpApi(Protocol):
    """One API on the listener."""

    # Where it is mounted ("/v1"); the prefixes of two APIs never overlap.
    prefix: str
    # The largest request body it takes.
    max_request_bytes: int
    # Routes (relative to `prefix`) of the client's liveness: answered at once, they take no slot of the
    # caller's calls in flight (only of its rate), so a client whose own calls fill its slots stays alive.
    liveness_paths: frozenset[str]

    def routes(self) -> list[web.RouteDef]:
        """Its routes, relative to `prefix`; each handler finds the caller in `request[PRINCIPAL]`."""

    def token(self, request: web.Request) -> str | None:
        """The credential the API's clients send (None: none sent)."""

    def error(self, status: int, message: str, field: str | None = None) -> web.Response:
        """An error in the shape the API's official client reads (`field`: the request field at fault)."""


@dataclass(frozen=True)
class HttpConfig:
    host: str
    port: int
    # None: no authentication (`auth: none`): every caller is the cluster's own `system` principal.
    tokens: TokenStore | None
    limits: CallerLimits
    cert_file: Path | None = None
    key_file: Path | None = None


def _api_of(apis: list[HttpApi], path: str) -> HttpApi | None:
    return next((a for a in apis if path == a.prefix or path.startswith(a.prefix + "/")), None)


def _guard(apis: list[HttpApi], tokens: TokenStore | None, limiter: Limiter
           ) -> Callable[[web.Request, Callable[[web.Request], Awaitable[web.StreamResponse]]],
                         Awaitable[web.StreamResponse]]:
    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        api = _api_of(apis, request.path)
        if api is None:
            return web.json_response({"error": f"no API is served at {clean(request.path)[:200]}"}, status=404)
        principal = SYSTEM if tokens is None else tokens.principal_of(api.token(request))
        if principal is None:
            event(log, "gateway.unauthenticated", logging.WARNING, path=clean(request.path)[:200])
            return api.error(401, "a valid API key is required (`deploy/serve users add` issues one)")
        if request.content_length is not None and request.content_length > api.max_request_bytes:
            return api.error(413, f"the request is {request.content_length} bytes; this endpoint takes at most "
                                  f"{api.max_request_bytes}")
        key = principal.name if tokens is not None else (request.remote or "")
        beat = request.path[len(api.prefix):] in api.liveness_paths
        try:
            if beat:
                limiter.admit_beat(key)
            else:
                limiter.admit(key, streaming=False, request_bytes=0, public=False)
        except OverLimit as err:
            return api.error(429, err.message)
        request[PRINCIPAL] = principal
        try:
            return await handler(request)
        except web.HTTPException as err:
            if err.status == 413:
                return api.error(413, f"the request is larger than {api.max_request_bytes} bytes")
            if err.status in (404, 405):
                return api.error(err.status, f"{request.method} {clean(request.path)[:200]} is not a route of "
                                             f"this API")
            raise
        except RpcError as err:
            return api.error(HTTP_STATUS.get(err.code, 500), err.message)
        except Exception as err:  # noqa: BLE001 - one clean line for the client, the cause in the log
            event(log, "gateway.http_error", logging.ERROR, path=clean(request.path)[:200], caller=principal.name,
                  error=f"{type(err).__name__}: {clean(str(err))[:300]}")
            return api.error(500, f"internal error ({type(err).__name__}); the gateway's log has the cause")
        finally:
            if not beat:
                limiter.release(key, streaming=False)

    return guard


async def start_http(cfg: HttpConfig, apis: list[HttpApi]) -> web.AppRunner:
    """Bind and start the listener on the running event loop; raises if the address cannot be bound."""
    app = web.Application(middlewares=[_guard(apis, cfg.tokens, Limiter(cfg.limits))],
                          client_max_size=max((a.max_request_bytes for a in apis), default=1024))
    for api in apis:
        sub = web.Application(client_max_size=api.max_request_bytes)
        sub.add_routes(api.routes())
        app.add_subapp(api.prefix, sub)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    context = None
    if cfg.cert_file is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cfg.cert_file, cfg.key_file)
    site = web.TCPSite(runner, cfg.host, cfg.port, ssl_context=context, reuse_port=False)
    await site.start()
    event(log, "gateway.http_listening", address=f"{cfg.host}:{cfg.port}", tls=context is not None,
          apis=[a.prefix for a in apis])
    return runner
