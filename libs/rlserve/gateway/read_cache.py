"""Answers to read-only calls (GetRun, ListRuns), shared for a moment between identical calls of one caller.

A call forwarded to the coordinator costs a Serve handle hop (~6 ms on an idle
2-core machine: BENCHMARKS.md "What the public endpoint costs"). Hundreds of
callers polling their runs while the machine trains turn that into a queue of
seconds for everyone (the first soak: p99 11 s). A run's state changes at the
pace of a training step, so identical calls need not each cross the cluster:

- calls that arrive while an identical one is forwarded wait for its answer
  (one forwarded call per key at a time, however many callers poll);
- calls within `ttl_s` of an answer get that answer.

A key is (caller, method, request bytes): an answer never crosses callers, so
what a caller may read is decided by the coordinator as before. Any write
through the gateway (SubmitRun, CancelRun, ... by anyone) makes every answer
old, and a read after it never joins a call forwarded before it: what anyone
wrote is read at once (an admin listing runs sees the run a user just
submitted). What the coordinator changes by itself (a run's steps) shows within
`ttl_s`. Failures are not kept. The cache holds at most `max_bytes` of answers,
oldest dropped first.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

# What the run-facing read-only RPCs are called; everything else public is a write.
READ_ONLY = frozenset({"GetRun", "ListRuns"})


@dataclass
class _Answer:
    data: bytes
    at: float  # when the call that got it was forwarded


class ReadCache:
    def __init__(self, ttl_s: float, max_bytes: int = 64 * 2**20):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._answers: OrderedDict[tuple, _Answer] = OrderedDict()
        self._bytes = 0
        self._pending: dict[tuple, tuple[asyncio.Task, float]] = {}
        self._wrote = float("-inf")  # when the last write went through

    async def get(self, caller: Hashable, method: str, request: bytes,
                  fetch: Callable[[], Awaitable[bytes]]) -> bytes:
        """The answer to `request` for `caller`: a fresh one (within ttl_s, after the last write), the one
        being fetched (if forwarded after the last write), or `fetch()`'s."""
        key = (caller, method, request)
        now = time.monotonic()
        answer = self._answers.get(key)
        if answer is not None and now - answer.at < self.ttl_s and answer.at > self._wrote:
            return answer.data
        pending = self._pending.get(key)
        if pending is None or pending[1] <= self._wrote:
            # A task of its own: a caller that goes away does not cancel the answer others wait for.
            pending = self._pending[key] = (asyncio.ensure_future(self._fetch(key, fetch, now)), now)
        return await asyncio.shield(pending[0])

    async def _fetch(self, key: tuple, fetch: Callable[[], Awaitable[bytes]], started: float) -> bytes:
        try:
            data = await fetch()
        finally:
            if self._pending.get(key, (None, None))[1] == started:
                del self._pending[key]
        if self.ttl_s > 0 and started > self._wrote:
            self._keep(key, _Answer(data, started))
        return data

    def _keep(self, key: tuple, answer: _Answer) -> None:
        old = self._answers.pop(key, None)
        if old is not None:
            self._bytes -= len(old.data)
        if len(answer.data) > self.max_bytes:
            return
        self._answers[key] = answer
        self._bytes += len(answer.data)
        while self._bytes > self.max_bytes:
            _, dropped = self._answers.popitem(last=False)
            self._bytes -= len(dropped.data)

    def wrote(self) -> None:
        """A write went through: every answer so far, and every call forwarded before now, is old."""
        self._wrote = time.monotonic()
        self._answers.clear()
        self._bytes = 0
