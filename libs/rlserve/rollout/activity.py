"""Engine idle time: how long an engine had nothing to generate, or was held by a weight update.

The async loop's promise is an engine that never waits; this clock is how
that is checked. It is driven by the engine's own request and pause events
(no polling) and read as cumulative seconds (`EngineStats`), with the tokens
the engine generated: runs that share the engines split its busy time by them.
"""

from __future__ import annotations

import time

from rlserve.rollout.interfaces import EngineStats


class Activity:
    def __init__(self) -> None:
        self._start = self._since = time.monotonic()
        self._idle = self._paused = 0.0
        self._running = 0
        self._pauses = 0
        self._tokens = 0

    def _advance(self) -> None:
        """Credit the time since the last event to idle (and paused) as the state was then."""
        now = time.monotonic()
        elapsed = now - self._since
        if self._pauses:
            self._paused += elapsed
        if self._pauses or not self._running:
            self._idle += elapsed
        self._since = now

    def request_started(self) -> None:
        self._advance()
        self._running += 1

    def request_finished(self, generated_tokens: int = 0) -> None:
        self._advance()
        self._running -= 1
        self._tokens += generated_tokens

    def paused(self) -> None:
        self._advance()
        self._pauses += 1

    def resumed(self) -> None:
        self._advance()
        self._pauses -= 1

    def stats(self) -> EngineStats:
        self._advance()
        return EngineStats(uptime_s=self._since - self._start, idle_s=self._idle, paused_s=self._paused,
                           requests_running=self._running, generated_tokens=self._tokens)
