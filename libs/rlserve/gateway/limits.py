"""Per-caller limits at the endpoint: no caller can take the service from the others.

Each caller (a principal's name, so all of a user's tokens share one set of
limits; the peer address when authentication is off) gets at most
`max_streams` open streams (WatchRun), `max_in_flight` unary calls at once,
`rate` calls per second with bursts of `burst` (a token bucket), and requests
of at most `max_request_kb` (public RPCs; internal ones, admin-only, carry
training batches and take the gateway's message limit). A call over a limit gets RESOURCE_EXHAUSTED at once, before it is
decoded or forwarded, naming the limit and the cluster-file key that sets it. Without the internal RPCs on the
endpoint, gRPC's transport refuses a request over `max_request_kb` before the limiter sees it (`server.start`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class CallerLimits(BaseModel):
    """The cluster file's `limits` section (the defaults serve a team's clients with room to spare)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_streams: int = Field(16, ge=1, le=100_000)
    max_in_flight: int = Field(32, ge=1, le=100_000)
    rate: float = Field(50.0, gt=0, le=1e6)
    burst: int = Field(100, ge=1, le=1_000_000)
    max_request_kb: int = Field(512, ge=1, le=1_048_576)


class OverLimit(Exception):
    """A caller is over one of its limits; the message names it."""


@dataclass
class _Caller:
    tokens: float
    refilled: float
    streams: int = 0
    in_flight: int = 0


@dataclass
class Limiter:
    limits: CallerLimits
    _callers: dict[str, _Caller] = field(default_factory=dict)

    def _caller(self, key: str) -> _Caller:
        caller = self._callers.get(key)
        if caller is None:
            caller = self._callers[key] = _Caller(float(self.limits.burst), time.monotonic())
        return caller

    def admit(self, key: str, streaming: bool, request_bytes: int, public: bool) -> None:
        """Take a call slot (release it with `release`); OverLimit when the caller has none left."""
        limits = self.limits
        if public and request_bytes > limits.max_request_kb * 1024:
            raise OverLimit(f"the request is {request_bytes // 1024} KiB; this endpoint takes at most "
                            f"{limits.max_request_kb} KiB (limits.max_request_kb)")
        caller = self._caller(key)
        self._refill(caller)
        if caller.tokens < 1:
            raise OverLimit(f"more than {limits.rate:g} calls per second (limits.rate, bursts of limits.burst "
                            f"{limits.burst}); slow down")
        if streaming and caller.streams >= limits.max_streams:
            raise OverLimit(f"{caller.streams} streams open; at most {limits.max_streams} at once "
                            f"(limits.max_streams)")
        if not streaming and caller.in_flight >= limits.max_in_flight:
            raise OverLimit(f"{caller.in_flight} calls in flight; at most {limits.max_in_flight} at once "
                            f"(limits.max_in_flight)")
        caller.tokens -= 1
        if streaming:
            caller.streams += 1
        else:
            caller.in_flight += 1

    def _refill(self, caller: _Caller) -> None:
        now = time.monotonic()
        caller.tokens = min(float(self.limits.burst), caller.tokens + (now - caller.refilled) * self.limits.rate)
        caller.refilled = now

    def release(self, key: str, streaming: bool) -> None:
        caller = self._callers[key]
        self._refill(caller)
        if streaming:
            caller.streams -= 1
        else:
            caller.in_flight -= 1
        if not caller.streams and not caller.in_flight and caller.tokens >= self.limits.burst:
            del self._callers[key]  # an idle caller costs no memory
