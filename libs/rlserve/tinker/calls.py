"""The Tinker API's operations over plain data, where its sessions live (the coordinator on a cluster): each
takes the caller and what the listener read (a JSON body, a protobuf body, path parameters) and answers a
`Reply` (JSON, or protobuf bytes, or an error naming the field), never an exception, so the listener in
the gateway reaches them through one typed call (`api.TinkerBackend.call`) whatever lies between.

`retrieve_future` long-polls here up to `poll_s` and answers "try again" with the queue state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rlserve.logs import event
from rlserve.rpc import RpcError, clean
from rlserve.security.principal import Principal
from rlserve.tinker import wire
from rlserve.tinker.api import Reply
from rlserve.tinker.futures import Future, UserError
from rlserve.tinker.service import TinkerService

log = logging.getLogger("rlserve.tinker")


def _future(future: Future, **extra: Any) -> Reply:
    return Reply(json={"request_id": future.request_id, **extra})


class TinkerCalls:
    """`TinkerBackend` in the process that holds the service."""

    OPS = frozenset({"capabilities", "create_session", "heartbeat", "finish_session", "create_model", "get_info",
                     "unload_model", "forward_backward", "optim_step", "save_weights", "save_for_sampler",
                     "load_weights", "create_sampler", "get_sampler", "asample", "retrieve_future", "cancel_future",
                     "weights_info", "training_runs", "training_run", "checkpoints", "user_checkpoints",
                     "delete_checkpoint"})

    def __init__(self, service: TinkerService, poll_s: float = 10.0):
        self.service, self.poll_s = service, poll_s

    async def call(self, caller: Principal, op: str, *args: Any) -> Reply:
        if op not in self.OPS:
            return Reply(404, {"detail": f"no operation {op!r}"})
        fn: Callable[..., Awaitable[Reply]] = getattr(self, op)
        try:
            await self.service.ready()
            return await fn(caller, *args)
        except UserError as err:
            return Reply(404 if err.missing else 400, {"detail": str(err)}, field=err.field)
        except RpcError as err:  # the cluster refused (a quota, a learner's check): the caller's to read
            return Reply(429 if err.code.name == "RESOURCE_EXHAUSTED" else 400, {"detail": err.message})
        except Exception as err:  # noqa: BLE001 - one line to the client, the cause in the log
            event(log, "tinker.call_failed", logging.WARNING, op=op, error=clean(str(err))[:300])
            return Reply(500, {"detail": f"{type(err).__name__}: {clean(str(err))[:300]}"})

    # --- sessions and models ------------------------------------------------------------------------

    async def capabilities(self, caller: Principal) -> Reply:
        return Reply(json={"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                                for name in sorted(self.service.bases)]})

    async def create_session(self, caller: Principal, body: dict[str, Any]) -> Reply:
        return Reply(json={"type": "create_session", "session_id": self.service.create_session(caller.name)})

    async def heartbeat(self, caller: Principal, body: dict[str, Any]) -> Reply:
        sid = wire.field_of(body, "session_id", str)
        if not self.service.heartbeat(caller.name, sid):
            return Reply(410, {"detail": f"session {sid!r} has ended"}, field="session_id")
        return Reply(json={"type": "session_heartbeat"})

    async def finish_session(self, caller: Principal, sid: str) -> Reply:
        await self.service.finish_session(caller.name, sid)
        return Reply(json={})

    async def create_model(self, caller: Principal, body: dict[str, Any]) -> Reply:
        future = self.service.create_model(caller, body)
        return _future(future, model_id=f"{body['session_id']}:train:{body['model_seq_id']}")

    async def get_info(self, caller: Principal, body: dict[str, Any]) -> Reply:
        return Reply(json=self.service.info(caller.name, wire.field_of(body, "model_id", str)))

    async def unload_model(self, caller: Principal, body: dict[str, Any]) -> Reply:
        model_id = wire.field_of(body, "model_id", str)
        self.service.model(caller.name, model_id)
        future = self.service.futures.submit(caller.name, lambda f: self.service.unload(caller.name, model_id))
        return _future(future, model_id=model_id)

    # --- the primitives ---------------------------------------------------------------------------------

    async def forward_backward(self, caller: Principal, raw: bytes, encoding: str | None) -> Reply:
        future = self.service.forward_backward(caller.name, raw, encoding)
        return _future(future)

    async def optim_step(self, caller: Principal, body: dict[str, Any]) -> Reply:
        return _future(self.service.optim_step(caller.name, body), model_id=body.get("model_id"))

    async def save_weights(self, caller: Principal, body: dict[str, Any]) -> Reply:
        return _future(self.service.save(caller.name, body, for_sampler=False), model_id=body.get("model_id"))

    async def save_for_sampler(self, caller: Principal, body: dict[str, Any]) -> Reply:
        return _future(self.service.save(caller.name, body, for_sampler=True), model_id=body.get("model_id"))

    async def load_weights(self, caller: Principal, body: dict[str, Any]) -> Reply:
        return _future(self.service.load(caller, body))

    # --- sampling -----------------------------------------------------------------------------------

    async def create_sampler(self, caller: Principal, body: dict[str, Any]) -> Reply:
        sid = self.service.create_sampler(caller.name, body)
        return Reply(json={"type": "create_sampling_session", "sampling_session_id": sid})

    async def get_sampler(self, caller: Principal, sid: str) -> Reply:
        return Reply(json=self.service.sampler_info(caller.name, sid))

    async def asample(self, caller: Principal, body: dict[str, Any]) -> Reply:
        future, ids = self.service.sample(caller.name, body)
        return _future(future, sample_sequence_ids=ids)

    # --- futures ------------------------------------------------------------------------------------

    async def retrieve_future(self, caller: Principal, body: dict[str, Any]) -> Reply:
        rid = wire.field_of(body, "request_id", str)
        future = self.service.futures.get(caller.name, rid)
        if future is None:
            raise UserError("request_id", f"no future {rid!r}", missing=True)
        if future.task is not None and not future.task.done():
            await asyncio.wait({future.task}, timeout=self.poll_s)
        if future.task is not None and not future.task.done():
            return Reply(json={"type": "try_again", "request_id": rid, "queue_state": future.queue_state,
                               "queue_state_reason": future.queue_state_reason})
        if future.error is not None:
            return Reply(json={"error": future.error[0], "category": future.error[1]})
        if isinstance(future.result, bytes):
            return Reply(proto=future.result)
        return Reply(json=future.result)

    async def cancel_future(self, caller: Principal, body: dict[str, Any]) -> Reply:
        future = self.service.futures.get(caller.name, wire.field_of(body, "request_id", str))
        if future is not None and future.task is not None:
            future.task.cancel()
        return Reply(json={})

    # --- REST reads ---------------------------------------------------------------------------------

    async def weights_info(self, caller: Principal, body: dict[str, Any]) -> Reply:
        return Reply(json=self.service.weights_info(caller.name, wire.field_of(body, "tinker_path", str)))

    async def training_runs(self, caller: Principal, limit: int, offset: int) -> Reply:
        runs = self.service.training_runs(caller.name)
        return Reply(json={"training_runs": runs[offset:offset + limit],
                           "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}})

    async def training_run(self, caller: Principal, run: str) -> Reply:
        return Reply(json=self.service.training_run(caller.name, run))

    async def checkpoints(self, caller: Principal, run: str) -> Reply:
        return Reply(json={"checkpoints": self.service.checkpoints(caller.name, run)})

    async def user_checkpoints(self, caller: Principal, limit: int, offset: int) -> Reply:
        out = [c for run in self.service.training_runs(caller.name)
               for c in self.service.checkpoints(caller.name, run["training_run_id"])]
        return Reply(json={"checkpoints": out[offset:offset + limit],
                           "cursor": {"offset": offset, "limit": limit, "total_count": len(out)}})

    async def delete_checkpoint(self, caller: Principal, run: str, kind: str, name: str) -> Reply:
        self.service.delete_checkpoint(caller.name, run, kind, name)
        return Reply(json={})
