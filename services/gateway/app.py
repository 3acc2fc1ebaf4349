"""The gateway Serve application: the cluster's public gRPC endpoint.

Its replica runs a grpc.aio server on the cluster file's `host:grpc_port`
(`rlserve.gateway.server`: bearer tokens, principals, roles, TLS) and
forwards each call to the service's Serve deployment through a handle, the
same path the coordinator uses inside the cluster; a run-facing call carries
the caller's principal as an argument after the request. Beside it, on `host:http_port`, the HTTP
listener (`rlserve.gateway.http`) serves the public APIs other ecosystems speak, each under its prefix
(`_http_apis`: the OpenAI-compatible endpoint `rlserve.agents.openai_api` under /v1, the Tinker API
`rlserve.tinker.api` under /api/v1 over the coordinator's `tinker` operations), with the same
tokens, per-caller limits and TLS, over the same handles. Serve's own proxies are off, so these are
the only ways in from outside.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from google.protobuf.message import Message
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle

from rlserve.agents.openai_api import OpenAiApi
from rlserve.cluster.deployment import build_app
from rlserve.cpu_affinity import place_from_env
from rlserve.gateway import server
from rlserve.gateway.http import HttpApi, HttpConfig, start_http
from rlserve.gateway.methods import RpcMethod, all_methods
from rlserve.gateway.run_table import RunTable
from rlserve.logs import event, setup_logging
from rlserve.rpc import clean, status_of
from rlserve.security.identity import TokenStore
from rlserve.security.principal import Principal, Role
from rlserve.tenancy.legacy import GATEWAY_ARGS, log_deprecated, migrate_args
from rlserve.tenancy.policy import TenancyPolicy
from rlserve.tinker.api import Reply, TinkerApi
from rlserve.v1 import agents_pb2
from rlserve.v1 import coordinator_pb2 as pb

log = logging.getLogger("rlserve.gateway")


class TokenFiles(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_file: str
    admin_token_file: str
    # Named users (`deploy/serve users`); None: only the two token files.
    users_file: str | None = None


class TlsFiles(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cert_file: str
    key_file: str


class GatewayArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(9000, gt=0, lt=65536)
    # The HTTP listener's port on `host` (the cluster file's `http_port`); None: no HTTP listener.
    http_port: int | None = Field(9001, gt=0, lt=65536)
    # None: no authentication (`auth: none` in the cluster file, warned at every start). Required,
    # so there is no module-level default app: an endpoint without a decision on auth is not deployable.
    auth: TokenFiles | None
    tls: TlsFiles | None = None
    expose_internal: bool = False
    apps: dict[str, str] = {}
    max_message_mb: int = Field(64, ge=1, le=1024)
    # The cluster file's `tenancy`: the gateway holds each caller to its `callers` limits.
    tenancy: TenancyPolicy = TenancyPolicy()
    # Old keys these args were given (`limits`), each with its `tenancy` key: read as that key, logged at start.
    deprecated_keys: dict[str, str] = {}
    read_cache_ms: int = Field(0, ge=0, le=10_000)
    # The coordinator's `watch_max_s`: a WatchRun stream served from the gateway's copy ends after it too.
    watch_max_s: float = Field(600.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _old_tenancy_keys(cls, data: Any) -> Any:
        return migrate_args(data, GATEWAY_ARGS)


@serve.deployment(ray_actor_options={"num_cpus": 0.05}, max_ongoing_requests=4)
class Gateway:
    async def __init__(self, args: dict | None = None):
        setup_logging()
        place_from_env()
        self.args = GatewayArgs.model_validate(args or {})
        log_deprecated(log, "the gateway's args", self.args.deprecated_keys)
        auth, tls = self.args.auth, self.args.tls
        tokens = None
        if auth is None:
            event(log, "gateway.auth_off", logging.WARNING,
                  message="`auth: none`: anyone who can reach the endpoint can use it")
        else:
            tokens = TokenStore({Role.USER: Path(auth.token_file), Role.ADMIN: Path(auth.admin_token_file)},
                                Path(auth.users_file) if auth.users_file else None)
        self.handles: dict[str, DeploymentHandle] = {}
        self.runs = RunTable()
        self.feed = asyncio.ensure_future(self._follow_runs())
        self.server = await server.start(
            server.GatewayConfig(host=self.args.host, port=self.args.port, tokens=tokens,
                                 expose_internal=self.args.expose_internal, apps=self.args.apps,
                                 limits=self.args.tenancy.callers,
                                 cert_file=Path(tls.cert_file) if tls else None,
                                 key_file=Path(tls.key_file) if tls else None,
                                 max_message_mb=self.args.max_message_mb, read_cache_ms=self.args.read_cache_ms,
                                 watch_max_s=self.args.watch_max_s),
            self._forward, self._forward_stream, self.runs)
        self.http = None
        if self.args.http_port is not None:
            self.http = await start_http(
                HttpConfig(self.args.host, self.args.http_port, tokens, self.args.tenancy.callers,
                           Path(tls.cert_file) if tls else None, Path(tls.key_file) if tls else None),
                self._http_apis())

    def _http_apis(self) -> list[HttpApi]:
        """The APIs of the HTTP listener, each under its own prefix."""
        return [OpenAiApi(ServeAgents(self._forward, self.args.apps)),
                TinkerApi(ServeTinker(self._handle, self.args.apps.get("coordinator", "coordinator")))]

    def _handle(self, app: str) -> DeploymentHandle:
        if app not in self.handles:
            self.handles[app] = serve.get_app_handle(app)
        return self.handles[app]

    @staticmethod
    def _args(method: RpcMethod, request: Message, caller: Principal | None) -> tuple:
        """The request, and for a run-facing RPC the caller (none without authentication: the coordinator
        then acts as the cluster itself)."""
        return (request, caller) if method.takes_caller and caller is not None else (request,)

    async def _forward(self, method: RpcMethod, request: Message, caller: Principal | None) -> Message:
        return await getattr(self._handle(method.app), method.name).remote(*self._args(method, request, caller))

    async def _forward_stream(self, method: RpcMethod, request: Message,
                              caller: Principal | None) -> AsyncIterator[Message]:
        stream = getattr(self._handle(method.app).options(stream=True), method.name).remote(
            *self._args(method, request, caller))
        try:
            async for item in stream:
                yield item
        finally:
            stream.cancel()  # the client went away or the stream ended: stop the replica's generator too

    async def _follow_runs(self) -> None:
        """Keep `self.runs` fed from the coordinator's run feeds: the next feed as soon as one ends, and after
        a failure (a coordinator restart, or none deployed yet) a retry each second, with reads and watches
        forwarded."""
        app = self.args.apps.get("coordinator", "coordinator")
        while True:
            feed = None
            try:
                feed = self._handle(app).options(stream=True).run_feed.remote()
                first = True
                async for batch in feed:
                    if first:
                        if not self.runs.live:
                            event(log, "gateway.run_feed", runs=len(batch.runs))
                        self.runs.replace(batch)
                        first = False
                    else:
                        self.runs.update(batch)
                continue
            except Exception as err:  # noqa: BLE001 - any failure of the feed means: forward, then reconnect
                if self.runs.live:
                    event(log, "gateway.run_feed_lost", logging.WARNING, error=clean(str(err))[:300])
            finally:
                if feed is not None:  # ended, failed, or this gateway is stopping: stop the coordinator's side too
                    feed.cancel()
            self.runs.down()
            await asyncio.sleep(1.0)

    async def __del__(self):
        self.feed.cancel()
        if self.http is not None:
            await self.http.cleanup()
        await self.server.stop(grace=2)


class ServeAgents:
    """The OpenAI endpoint's backend (`rlserve.agents.openai_api.Backend`): the coordinator's Agents RPCs and
    ListRuns, forwarded with the caller like the gRPC endpoint's; a failure arrives as its RpcError."""

    def __init__(self, forward, apps: dict[str, str]):
        self.forward = forward
        self.methods = {m.name: m for m in all_methods(apps) if m.service in ("rlserve.v1.Agents",
                                                                              "rlserve.v1.Coordinator")}

    async def _call(self, name: str, request: Message, caller: Principal) -> Any:
        try:
            return await self.forward(self.methods[name], request, caller)
        except Exception as err:  # noqa: BLE001 - whatever the handle raised, as the status it means
            raise status_of(err) from None

    async def list_runs(self, caller: Principal) -> list[pb.Run]:
        return list((await self._call("ListRuns", pb.ListRunsRequest(), caller)).runs)

    async def next_episode(self, req: agents_pb2.NextEpisodeRequest, caller: Principal
                           ) -> agents_pb2.NextEpisodeResponse:
        return await self._call("NextEpisode", req, caller)

    async def start_episode(self, req: agents_pb2.StartEpisodeRequest, caller: Principal
                            ) -> agents_pb2.StartEpisodeResponse:
        return await self._call("StartEpisode", req, caller)

    async def chat(self, req: agents_pb2.ChatRequest, caller: Principal) -> agents_pb2.ChatResponse:
        return await self._call("Chat", req, caller)

    async def end_episode(self, req: agents_pb2.EndEpisodeRequest, caller: Principal
                          ) -> agents_pb2.EndEpisodeResponse:
        return await self._call("EndEpisode", req, caller)


class ServeTinker:
    """The Tinker API's backend (`rlserve.tinker.calls.TinkerBackend`): its operations on the coordinator, which
    holds the sessions and runs the models; a coordinator that cannot be reached answers 503."""

    def __init__(self, handle, app: str):
        self.handle, self.app = handle, app

    async def call(self, caller: Principal, op: str, *args: Any) -> Reply:
        try:
            return await self.handle(self.app).tinker.remote(caller, op, *args)
        except Exception as err:  # noqa: BLE001 - whatever the handle raised, as the status it means
            status = status_of(err)
            return Reply(503 if status.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else 500,
                         {"detail": f"the coordinator: {status.message}"})


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.gateway.app:build`)."""
    return build_app(Gateway, GatewayArgs, args)
