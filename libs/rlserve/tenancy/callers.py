"""Each caller's share of the endpoint: no caller can take the service from the others.

Each caller (a principal's name, so all of a user's tokens share one set of limits; the peer address when
authentication is off) gets at most `tenancy.callers.max_streams` open streams (WatchRun),
`max_calls_in_flight` unary calls at once, `calls_per_s` calls a second with bursts of `call_burst` (a token
bucket), and requests of at most `max_request_kb` (public RPCs; internal ones, admin-only, carry training
batches and take the gateway's message limit). A call over a limit gets RESOURCE_EXHAUSTED at once, before it
is decoded or forwarded, naming the limit's key (`CallerLimits`). Without the internal RPCs on the endpoint,
gRPC's transport refuses a request over `max_request_kb` before the limiter sees it (`gateway.server.start`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlserve.tenancy.policy import CallerLimits
from rlserve.tenancy.token_bucket import TokenBucket


@dataclass
class _Caller:
    calls: TokenBucket
    streams: int = 0
    in_flight: int = 0


@dataclass
class Limiter:
    """The gateway's count of each caller's calls, checked against `limits` (`OverLimit` when over)."""

    limits: CallerLimits
    _callers: dict[str, _Caller] = field(default_factory=dict)

    def admit(self, key: str, streaming: bool, request_bytes: int, public: bool) -> None:
        """Take a call slot (release it with `release`); OverLimit when the caller has none left."""
        if public:
            self.limits.check_request_size(request_bytes)
        caller = self._callers.get(key)
        if caller is None:
            caller = self._callers[key] = _Caller(TokenBucket(self.limits.calls_per_s, self.limits.call_burst))
        self.limits.check_call(streaming, caller.streams, caller.in_flight, caller.calls.level())
        caller.calls.take()
        if streaming:
            caller.streams += 1
        else:
            caller.in_flight += 1

    def admit_beat(self, key: str) -> None:
        """A call that takes no slot of `max_calls_in_flight`, only a token of the rate (OverLimit without one):
        a client's liveness call, answered at once, which its own calls in flight must not starve."""
        caller = self._callers.get(key)
        if caller is None:
            caller = self._callers[key] = _Caller(TokenBucket(self.limits.calls_per_s, self.limits.call_burst))
        self.limits.check_call(False, caller.streams, 0, caller.calls.level())
        caller.calls.take()

    def release(self, key: str, streaming: bool) -> None:
        caller = self._callers[key]
        if streaming:
            caller.streams -= 1
        else:
            caller.in_flight -= 1
        if not caller.streams and not caller.in_flight and caller.calls.full:
            del self._callers[key]  # an idle caller costs no memory
