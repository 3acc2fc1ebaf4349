"""The Tinker API's routes under `/api/v1` (an `HttpApi` of `rlserve.gateway.http`): the requests the `tinker`
SDK 0.38 sends (its `resources/` and `lib/public_interfaces/`), bodies parsed here (no framework binding),
answers in the shapes of `tinker.types`. The caller is the listener's principal: the SDK sends its key as
`X-API-Key` (a `tml-` key from `deploy/serve users add NAME --tinker`).

Errors: a body that cannot be read, or a call on a missing (or another user's) session, model or sampler,
is a 4xx JSON `{"detail", "field"}` at once; a model's call whose values are wrong gets a future that fails
with the SDK's user category naming the field (it holds the call's seq id, so the calls after it still run
in order); `retrieve_future` long-polls up to `poll_s` and answers "try again" with the queue state.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from rlserve.gateway.http import PRINCIPAL
from rlserve.tinker import wire
from rlserve.tinker.futures import Future, UserError
from rlserve.tinker.service import TinkerService

_PROTO = "application/x-protobuf"
# The client config this server answers: API keys (no JWT exchange), httpx's own transport, plain protobuf
# forward_backward bodies (aiohttp's parser refuses `Content-Encoding: zstd` without the backports.zstd
# package; `wire` reads zstd bodies all the same), custom losses client-side, sample futures one by one.
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                 "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": True, "custom_loss_server_side": False,
                 "sample_use_retrieve_futures": False, "sample_join_sampling_session": False}


class TinkerApi:
    prefix = "/api/v1"
    max_request_bytes = 64 * 2**20

    def __init__(self, service: TinkerService, poll_s: float = 10.0):
        self.service, self.poll_s = service, poll_s

    def token(self, request: web.Request) -> str | None:
        return request.headers.get("X-API-Key")

    def error(self, status: int, message: str, field: str | None = None) -> web.Response:
        return web.json_response({"detail": message, "field": field}, status=status)

    def routes(self) -> list[web.RouteDef]:
        post, get = web.post, web.get
        return [
            post("/client/config", self.client_config), post("/client/dynamic_config", self.dynamic_config),
            get("/healthz", self.healthz), get("/get_server_capabilities", self.capabilities),
            post("/telemetry", self.telemetry), post("/create_session", self.create_session),
            post("/session_heartbeat", self.heartbeat), post("/sessions/{sid}/finish", self.finish),
            post("/create_model", self.create_model), post("/get_info", self.get_info),
            post("/unload_model", self.unload_model), post("/forward_backward", self.forward_backward),
            post("/optim_step", self.optim_step), post("/save_weights", self.save_weights),
            post("/save_weights_for_sampler", self.save_for_sampler), post("/load_weights", self.load_weights),
            post("/create_sampling_session", self.create_sampler), get("/samplers/{sid}", self.get_sampler),
            post("/asample", self.asample), post("/retrieve_future", self.retrieve_future),
            post("/cancel_future", self.cancel_future), post("/weights_info", self.weights_info),
            get("/training_runs", self.training_runs), get("/training_runs/{run}", self.training_run),
            get("/training_runs/{run}/checkpoints", self.checkpoints), get("/checkpoints", self.user_checkpoints),
            web.delete("/training_runs/{run}/checkpoints/{kind}/{name}", self.delete_checkpoint),
        ]

    # --- helpers --------------------------------------------------------------------------------

    def _owner(self, request: web.Request) -> str:
        return request[PRINCIPAL].name

    async def _json(self, request: web.Request) -> dict[str, Any]:
        return wire.body_json(await request.read())

    def _user_error(self, err: UserError) -> web.Response:
        missing = str(err).split(": ", 1)[-1].startswith("no ")
        return self.error(404 if missing else 400, str(err), err.field)

    async def _call(self, request: web.Request, fn) -> web.Response:
        try:
            return await fn(self._owner(request))
        except UserError as err:
            return self._user_error(err)

    @staticmethod
    def _future(future: Future, **extra: Any) -> web.Response:
        return web.json_response({"request_id": future.request_id, **extra})

    # --- session and service ----------------------------------------------------------------------

    async def client_config(self, request: web.Request) -> web.Response:
        return web.json_response(CLIENT_CONFIG)

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def telemetry(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})  # the SDK's telemetry is not kept

    async def capabilities(self, request: web.Request) -> web.Response:
        models = [{"model_name": name, "trainable": True, "sampleable": True} for name in sorted(self.service.cfg.bases)]
        return web.json_response({"supported_models": models})

    async def create_session(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            await self._json(request)
            return web.json_response({"type": "create_session", "session_id": self.service.create_session(owner)})
        return await self._call(request, go)

    async def heartbeat(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            sid = wire.field_of(await self._json(request), "session_id", str)
            if not self.service.heartbeat(owner, sid):
                return self.error(410, f"session {sid!r} has ended", "session_id")
            return web.json_response({"type": "session_heartbeat"})
        return await self._call(request, go)

    async def finish(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            await self.service.finish_session(owner, request.match_info["sid"])
            return web.json_response({})
        return await self._call(request, go)

    # --- models and the primitives ----------------------------------------------------------------

    async def create_model(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            body = await self._json(request)
            future = self.service.create_model(owner, body)
            return self._future(future, model_id=f"{body['session_id']}:train:{body['model_seq_id']}")
        return await self._call(request, go)

    async def get_info(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            body = await self._json(request)
            return web.json_response(self.service.info(owner, wire.field_of(body, "model_id", str)))
        return await self._call(request, go)

    async def unload_model(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            model_id = wire.field_of(await self._json(request), "model_id", str)
            self.service.model(owner, model_id)
            return self._future(self.service.futures.submit(owner, lambda f: self.service.unload(owner, model_id)),
                                model_id=model_id)
        return await self._call(request, go)

    async def forward_backward(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            msg = wire.parse_forward_backward(await request.read(), request.headers.get("Content-Encoding"))
            model = self.service.model(owner, msg.model_id)
            try:
                req: Any = wire.read_datums(msg, self.service.vocab_size(model.base), self.service.cfg.max_datum_tokens,
                                            self.service.cfg.max_datums)
            except UserError as err:
                req = err  # fails in the call's turn, keeping the order of the calls after it
            return self._future(self.service.forward_backward(owner, req, msg.model_id, msg.seq_id),
                                model_id=msg.model_id)
        return await self._call(request, go)

    async def optim_step(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            body = await self._json(request)
            return self._future(self.service.optim_step(owner, body), model_id=body.get("model_id"))
        return await self._call(request, go)

    async def save_weights(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            body = await self._json(request)
            return self._future(self.service.save(owner, body, for_sampler=False), model_id=body.get("model_id"))
        return await self._call(request, go)

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            body = await self._json(request)
            return self._future(self.service.save(owner, body, for_sampler=True), model_id=body.get("model_id"))
        return await self._call(request, go)

    async def load_weights(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            body = await self._json(request)
            return self._future(self.service.load(owner, body))
        return await self._call(request, go)

    # --- sampling -----------------------------------------------------------------------------------

    async def create_sampler(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            sid = self.service.create_sampler(owner, await self._json(request))
            return web.json_response({"type": "create_sampling_session", "sampling_session_id": sid})
        return await self._call(request, go)

    async def get_sampler(self, request: web.Request) -> web.Response:
        return await self._call(request, lambda owner: _ok(self.service.sampler_info(owner, request.match_info["sid"])))

    async def asample(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            future, ids = self.service.sample(owner, await self._json(request))
            return self._future(future, sample_sequence_ids=ids)
        return await self._call(request, go)

    # --- futures ------------------------------------------------------------------------------------

    async def retrieve_future(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            rid = wire.field_of(await self._json(request), "request_id", str)
            future = self.service.futures.get(owner, rid)
            if future is None:
                return self.error(404, f"no future {rid!r}", "request_id")
            if future.task is not None and not future.task.done():
                await asyncio.wait({future.task}, timeout=self.poll_s)
            if future.task is not None and not future.task.done():
                return web.json_response({"type": "try_again", "request_id": rid, "queue_state": future.queue_state,
                                          "queue_state_reason": future.queue_state_reason})
            if future.error is not None:
                return web.json_response({"error": future.error[0], "category": future.error[1]})
            if isinstance(future.result, bytes):
                return web.Response(body=future.result, content_type=_PROTO)
            return web.json_response(future.result)
        return await self._call(request, go)

    async def cancel_future(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            future = self.service.futures.get(owner, wire.field_of(await self._json(request), "request_id", str))
            if future is not None and future.task is not None:
                future.task.cancel()
            return web.json_response({})
        return await self._call(request, go)

    # --- REST reads ---------------------------------------------------------------------------------

    async def weights_info(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            path = wire.field_of(await self._json(request), "tinker_path", str)
            return web.json_response(self.service.weights_info(owner, path))
        return await self._call(request, go)

    async def training_runs(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            runs = self.service.training_runs(owner)
            limit, offset = _int(request, "limit", 20), _int(request, "offset", 0)
            return web.json_response({"training_runs": runs[offset:offset + limit],
                                      "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}})
        return await self._call(request, go)

    async def training_run(self, request: web.Request) -> web.Response:
        return await self._call(request, lambda owner: _ok(self.service.training_run(owner, request.match_info["run"])))

    async def checkpoints(self, request: web.Request) -> web.Response:
        return await self._call(request, lambda owner: _ok({"checkpoints": self.service.checkpoints(
            owner, request.match_info["run"])}))

    async def user_checkpoints(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            out = [c for run in self.service.training_runs(owner)
                   for c in self.service.checkpoints(owner, run["training_run_id"])]
            limit, offset = _int(request, "limit", 100), _int(request, "offset", 0)
            return web.json_response({"checkpoints": out[offset:offset + limit],
                                      "cursor": {"offset": offset, "limit": limit, "total_count": len(out)}})
        return await self._call(request, go)

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        async def go(owner: str) -> web.Response:
            m = request.match_info
            import shutil

            folder, _ = self.service.resolve_path(owner, f"tinker://{m['run']}/{m['kind']}/{m['name']}")
            shutil.rmtree(folder)
            return web.json_response({})
        return await self._call(request, go)


async def _ok(value: Any) -> web.Response:
    return web.json_response(value)


def _int(request: web.Request, name: str, default: int) -> int:
    try:
        return max(0, int(request.query.get(name, default)))
    except ValueError:
        raise UserError(name, "must be an integer") from None
