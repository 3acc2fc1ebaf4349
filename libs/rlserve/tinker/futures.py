"""The futures of the Tinker API: every call is answered at once with a request id; `retrieve_future`
answers "try again" (with the queue state: active, or paused for the user's quota or for capacity) until
the work is done, then its result or its failure (the SDK's `RequestFailedResponse`: a user error names
the field at fault, anything else is a server error).

A model's calls run in the order of their seq ids, as the SDK numbers them (`seq_id = request id + 1` per
training client; `forward_backward` chunks of one call share a range and may arrive in any order), and a
call is idempotent on the SDK's retries: a seq id seen before answers with the future it got then.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc

from rlserve.rpc import RpcError, clean

QueueState = Literal["active", "paused_capacity", "paused_rate_limit"]


class UserError(Exception):
    """A client's mistake: the SDK's user-category failure (or 400 where the call has no future yet; 404 with
    `missing`: a session, model, sampler, future or path the caller does not have)."""

    def __init__(self, field_name: str, message: str, missing: bool = False):
        super().__init__(f"{field_name}: {message}")
        self.field, self.missing = field_name, missing

    def __reduce__(self):  # keep the type across Ray's pickling
        return (type(self), (self.field, str(self).partition(": ")[2], self.missing))


@dataclass(eq=False)
class Future:
    request_id: str
    owner: str
    task: asyncio.Task | None = None
    queue_state: QueueState = "active"
    queue_state_reason: str | None = None
    result: Any = None  # what the SDK's future deserializes (bytes: protobuf)
    error: tuple[str, str] | None = None  # (message, "user" | "server")
    done_at: float | None = None


@dataclass
class Ordering:
    """A model's (or sampling session's) calls by seq id: each waits for the ones before it to have started
    (chunks of one call may run side by side), and a repeated seq id gets its first future back."""

    next_seq: int = 1
    seen: dict[int, str] = field(default_factory=dict)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def wait_turn(self, seq_id: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: seq_id <= self.next_seq)

    async def started(self, seq_id: int) -> None:
        async with self.changed:
            self.next_seq = max(self.next_seq, seq_id + 1)
            self.changed.notify_all()


class FutureTable:
    """Every open future of the API, by request id; a finished one is kept `keep_s` after it finished."""

    def __init__(self, keep_s: float = 3600.0):
        self.futures: dict[str, Future] = {}
        self.keep_s = keep_s
        self._ids = itertools.count(1)

    def submit(self, owner: str, work: Callable[[Future], Awaitable[Any]]) -> Future:
        """A new future running `work` (which may set its queue state while it waits)."""
        self._expire()
        future = Future(f"req-{next(self._ids)}-{time.monotonic_ns() % 10**9}", owner)
        self.futures[future.request_id] = future

        async def run() -> None:
            try:
                future.result = await work(future)
            except UserError as err:
                future.error = (str(err), "user")
            except asyncio.CancelledError:
                future.error = ("the request was cancelled", "server")
            except Exception as err:  # noqa: BLE001 - the client gets one line; the gateway's log the cause
                future.error = (_server_message(err), _category(err))
            finally:
                future.queue_state, future.done_at = "active", time.monotonic()

        future.task = asyncio.get_running_loop().create_task(run())
        return future

    def get(self, owner: str, request_id: str) -> Future | None:
        """The caller's future; another user's answers as a missing one."""
        future = self.futures.get(request_id)
        return future if future is not None and future.owner == owner else None

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, f in self.futures.items() if f.done_at is not None and now - f.done_at > self.keep_s]:
            del self.futures[rid]


def _category(err: Exception) -> str:
    if isinstance(err, RpcError) and err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                                  grpc.StatusCode.FAILED_PRECONDITION,
                                                  grpc.StatusCode.OUT_OF_RANGE,
                                                  grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                  grpc.StatusCode.PERMISSION_DENIED):
        return "user"
    return "server"


def _server_message(err: Exception) -> str:
    if isinstance(err, RpcError):
        return err.message
    return f"{type(err).__name__}: {clean(str(err))[:300]}"
