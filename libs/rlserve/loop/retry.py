"""Retries, back-off and time-outs for calls to the services.

Errors that may pass (a replica restarting, a service redeploying, a
time-out) are retried with exponential back-off, each retry announced
through `on_retry` (the run's RETRY event); an error that will not pass
(INVALID_ARGUMENT, NOT_FOUND, ...) or a service that stays down raises
`ServiceFailure` with a clear message. ABORTED means a service lost state the
run relies on (the learner's training session): no retry of that call can
help, so it raises `RunStateLost` at once, which the loop answers by
restoring the last checkpoint (`recovery.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from pydantic import BaseModel, ConfigDict, Field

from rlserve.loop.services import RunStateLost, ServiceFailure
from rlserve.rpc import status_of

T = TypeVar("T")
_FINAL = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
          grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS,
          grpc.StatusCode.UNIMPLEMENTED}


class RetryPolicy(BaseModel):
    """How calls to the other services are retried (the coordinator's `retry` arg in the cluster file)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    retries: int = Field(5, ge=0)
    first_backoff_s: float = Field(1.0, gt=0)
    max_backoff_s: float = Field(16.0, gt=0)
    # Per attempt.
    timeout_s: float = Field(900.0, gt=0)


class Retrying:
    """Runs calls under a RetryPolicy and remembers which are in progress (for the watchdog)."""

    def __init__(self, policy: RetryPolicy, on_retry: Callable[[str], None]):
        self.policy = policy
        self.on_retry = on_retry
        self._pending: dict[int, tuple[str, float]] = {}  # what, since (monotonic)
        self._ids = itertools.count()

    def oldest_pending(self) -> tuple[str, float] | None:
        if not self._pending:
            return None
        what, since = min(self._pending.values(), key=lambda p: p[1])
        return what, time.monotonic() - since

    async def call(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        """`make()` until it succeeds or fails for good; `what` names the call in messages."""
        key = next(self._ids)
        self._pending[key] = (what, time.monotonic())
        try:
            return await self._call(what, make)
        finally:
            del self._pending[key]

    async def _call(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        delay = self.policy.first_backoff_s
        for attempt in range(self.policy.retries + 1):
            try:
                return await asyncio.wait_for(make(), self.policy.timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - classified below
                status = status_of(err)
                code, message = status.code, status.message
                if code == grpc.StatusCode.ABORTED:
                    raise RunStateLost(f"{what}: {code.name}: {message}") from None
                if code in _FINAL:
                    raise ServiceFailure(f"{what}: {code.name}: {message}") from None
                if attempt == self.policy.retries:
                    raise ServiceFailure(f"{what} still failing after {self.policy.retries} retries: "
                                         f"{code.name}: {message}") from None
                self.on_retry(f"{what} failed ({code.name}: {message[:200]}); retry {attempt + 1}/"
                              f"{self.policy.retries} in {delay:.0f}s")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.policy.max_backoff_s)
        raise AssertionError("unreachable")
