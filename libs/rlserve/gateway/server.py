"""The gateway's gRPC server: authenticate, check the role, decode, forward, encode.

Ray Serve 2.60's gRPC proxy has no hook for authentication (its server takes
no interceptors, and HTTP middlewares do not apply to gRPC), so the public
endpoint is this small grpc.aio server. An interceptor resolves the bearer
token to its principal before anything else runs: a call without a valid
token gets UNAUTHENTICATED whatever method it names, before its request is
even decoded. The interceptor then builds the call's handler for that
principal, so the forwarder receives it as an argument (the run-facing RPCs
pass it on to the coordinator) and the caller's limits key on its name.
Handlers take raw bytes, so undecodable requests are
INVALID_ARGUMENT (not grpcio's INTERNAL), and an unknown method is grpcio's
UNIMPLEMENTED. What a forwarded call raises becomes its status through
`rlserve.rpc.status_of`: one clean line, never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rlserve.gateway.methods import RpcMethod, all_methods
from rlserve.gateway.read_cache import READ_ONLY, ReadCache
from rlserve.gateway.run_events import NotHeld
from rlserve.gateway.run_table import RunTable
from rlserve.logs import event
from rlserve.rpc import clean, status_of
from rlserve.security.identity import TokenStore
from rlserve.security.principal import Principal
from rlserve.security.tokens import bearer_token
from rlserve.tenancy.callers import Limiter
from rlserve.tenancy.policy import CallerLimits, OverLimit
from rlserve.v1 import coordinator_pb2 as pb

log = logging.getLogger("rlserve.gateway")

# (method, request, the caller's principal; None without authentication) -> response (or a stream of them).
Forward = Callable[[RpcMethod, Message, Principal | None], Awaitable[Message]]
ForwardStream = Callable[[RpcMethod, Message, Principal | None], AsyncIterator[Message]]
Handlers = Callable[[RpcMethod, Principal | None], grpc.RpcMethodHandler]
# Health checks answer without a token (load balancers probe them); they reveal nothing.
_OPEN = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


@dataclass(frozen=True)
class GatewayConfig:
    host: str
    port: int
    # None: no authentication (the cluster file says `auth: none`).
    tokens: TokenStore | None
    expose_internal: bool
    apps: dict[str, str]
    limits: CallerLimits
    cert_file: Path | None = None
    key_file: Path | None = None
    max_message_mb: int = 64
    # How long a caller's identical GetRun / ListRuns share one answer (`read_cache.py`); 0: only while forwarded.
    read_cache_ms: int = 0
    # A WatchRun stream the gateway serves ends after this long, as the coordinator's do (clients continue).
    watch_max_s: float = 600.0


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def abort(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)
    return grpc.unary_unary_rpc_method_handler(abort)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without a valid token; PERMISSION_DENIED for an internal RPC without an admin token;
    every admitted call handled for its principal (`handlers`) within its caller's limits
    (`rlserve.tenancy.callers`)."""

    def __init__(self, tokens: TokenStore | None, methods: dict[str, RpcMethod], limiter: Limiter,
                 handlers: Handlers):
        self.tokens = tokens
        self.methods = methods
        self.limiter = limiter
        self.handlers = handlers

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method in _OPEN:
            return await continuation(details)
        method = self.methods.get(details.method)
        if self.tokens is None:
            return _limited(self.handlers(method, None) if method else None, self.limiter, None, method)
        principal = self.tokens.principal_of(bearer_token(details.invocation_metadata))
        if principal is None:
            event(log, "gateway.unauthenticated", logging.WARNING, method=clean(details.method)[:200])
            return _deny(grpc.StatusCode.UNAUTHENTICATED,
                         "a valid `authorization: Bearer TOKEN` is required (`deploy/serve token` shows where "
                         "the cluster's token file is)")
        if method is None:
            return None  # grpcio answers UNIMPLEMENTED
        if not method.public and not principal.is_admin:
            event(log, "gateway.forbidden", logging.WARNING, method=details.method, caller=principal.name)
            return _deny(grpc.StatusCode.PERMISSION_DENIED, f"{details.method} is an internal RPC: it needs an "
                                                            f"admin token")
        return _limited(self.handlers(method, principal), self.limiter, principal.name, method)


def _limited(handler: grpc.RpcMethodHandler | None, limiter: Limiter, caller: str | None,
             method: RpcMethod | None) -> grpc.RpcMethodHandler | None:
    """`handler` run within the caller's limits: a slot taken before the request is decoded, given back
    when the call (or the stream) ends. `caller`: the principal's name; None (no authentication): the peer's
    address."""
    if handler is None or method is None:
        return handler  # grpcio answers UNIMPLEMENTED

    def admit(raw: bytes, context: grpc.aio.ServicerContext) -> str:
        key = caller or context.peer().rsplit(":", 1)[0]
        limiter.admit(key, method.server_streaming, len(raw), method.public)
        return key

    if method.server_streaming:
        async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            try:
                key = admit(raw, context)
            except OverLimit as err:
                await context.abort(err.code, err.message)
            try:
                async for item in handler.unary_stream(raw, context):
                    yield item
            finally:
                limiter.release(key, streaming=True)
        return grpc.unary_stream_rpc_method_handler(stream)

    async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            key = admit(raw, context)
        except OverLimit as err:
            await context.abort(err.code, err.message)
        try:
            return await handler.unary_unary(raw, context)
        finally:
            limiter.release(key, streaming=False)
    return grpc.unary_unary_rpc_method_handler(unary)


def _decode(method: RpcMethod, raw: bytes) -> Message | None:
    try:
        return method.request.FromString(raw)
    except (DecodeError, RuntimeWarning, ValueError):
        return None


def _unary_handler(method: RpcMethod, forward: Forward, caller: Principal | None, reads: ReadCache,
                   table: RunTable) -> grpc.RpcMethodHandler:
    """Decode, forward, encode. A run-facing read is answered from `table` where it can be, else through
    `reads` (identical calls of one caller share a forwarded call); a run-facing write makes every cached
    read old. What a run-facing answer says about runs updates `table`."""
    async def forwarded(request: Message) -> bytes:
        response = await forward(method, request, caller)
        if method.public:
            table.learn(response)
        return response.SerializeToString()

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = _decode(method, raw)
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid {method.request.DESCRIPTOR.full_name}")
        try:
            if not method.public:
                return await forwarded(request)
            if method.name in READ_ONLY:
                local = table.answer(method.name, request, caller)
                if local is not None:
                    return local.SerializeToString()
                return await reads.get(caller, method.name, raw, lambda: forwarded(request))
            try:
                return await forwarded(request)
            finally:
                reads.wrote()
        except Exception as err:  # noqa: BLE001 - every failure becomes a status
            status = status_of(err)
        await context.abort(status.code, status.message)
    return grpc.unary_unary_rpc_method_handler(handle)


def _stream_handler(method: RpcMethod, forward_stream: ForwardStream, caller: Principal | None, reads: ReadCache,
                    table: RunTable, watch_max_s: float) -> grpc.RpcMethodHandler:
    """A WatchRun is served from `table`'s events while it holds the watcher's next one, and forwarded from
    there on (`rlserve.gateway.run_events`). A stream the service ends (a run's events up to its end) makes
    every cached read old: a client that reads the run once its stream ended must see it ended. `table`
    notes each run event forwarded, for the same reason."""
    async def forwarded(request: Message) -> AsyncIterator[Message]:
        async for item in forward_stream(method, request, caller):
            if method.public:
                table.learn(item)
            yield item

    async def items(request: Message) -> AsyncIterator[Message]:
        local = table.watch(request, caller, watch_max_s) if method.name == "WatchRun" else None
        if local is not None:
            try:
                async for ev in local:
                    request.from_sequence = ev.sequence + 1
                    yield pb.WatchRunResponse(event=ev)
                return
            except NotHeld:
                pass
        async for item in forwarded(request):
            yield item

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        request = _decode(method, raw)
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid {method.request.DESCRIPTOR.full_name}")
        status = None
        try:
            async for item in items(request):
                yield item.SerializeToString()
            reads.wrote()
        except Exception as err:  # noqa: BLE001 - every failure becomes a status
            status = status_of(err)
        if status is not None:
            await context.abort(status.code, status.message)
    return grpc.unary_stream_rpc_method_handler(handle)


def served_methods(cfg: GatewayConfig) -> list[RpcMethod]:
    """The public RPCs, plus the internal ones when the cluster file exposes them."""
    return [m for m in all_methods(cfg.apps) if m.public or cfg.expose_internal]


async def start(cfg: GatewayConfig, forward: Forward, forward_stream: ForwardStream, table: RunTable
                ) -> grpc.aio.Server:
    """Bind and start the endpoint on the running event loop; raises if the address cannot be bound.
    `table`: the copy of the coordinator's runs that the caller keeps fed (never live: every read forwarded)."""
    methods = served_methods(cfg)
    # Without the internal RPCs no caller may send more than tenancy.callers.max_request_kb, so gRPC's transport
    # refuses a larger request from its length prefix, before reading it: a 60 MB request cost the gateway
    # 125 ms of CPU read in full and refused by the limiter, 16 ms refused this way
    # (scripts/bench/oversized_requests.py). With them, training batches come in and only the limiter
    # bounds the run-facing RPCs.
    limit = cfg.max_message_mb * 2**20 if cfg.expose_internal else cfg.limits.max_request_kb * 1024
    reads = ReadCache(cfg.read_cache_ms / 1000)

    def handlers(method: RpcMethod, caller: Principal | None) -> grpc.RpcMethodHandler:
        return (_stream_handler(method, forward_stream, caller, reads, table, cfg.watch_max_s)
                if method.server_streaming
                else _unary_handler(method, forward, caller, reads, table))

    server = grpc.aio.server(
        interceptors=[AuthInterceptor(cfg.tokens, {m.path: m for m in methods}, Limiter(cfg.limits), handlers)],
        # No port sharing: another process of this user must not be able to bind the endpoint too.
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", limit),
                 ("grpc.max_send_message_length", cfg.max_message_mb * 2**20),
                 # Pings on quiet connections: a client that vanished without closing its streams is
                 # noticed within ~80 s and its stream slots are given back.
                 ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000),
                 ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)])
    # The interceptor hands out every rlserve method's handler (it alone knows the caller); the server's own
    # table holds only the health service.
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{cfg.host}:{cfg.port}"
    if cfg.cert_file is not None:
        credentials = grpc.ssl_server_credentials([(cfg.key_file.read_bytes(), cfg.cert_file.read_bytes())])
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if not bound:
        raise RuntimeError(f"gateway: cannot bind {address}")
    await server.start()
    for service in sorted({m.service for m in methods}):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    event(log, "gateway.ready", address=address, tls=cfg.cert_file is not None, auth=cfg.tokens is not None,
          internal=cfg.expose_internal, rpcs=len(methods))
    return server
