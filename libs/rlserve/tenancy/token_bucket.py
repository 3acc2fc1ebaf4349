"""The one token bucket of rlserve: every limit on a rate (a caller's calls a second at the gateway, a caller's
seconds of the coordinator's spec reader) is one of these per caller.

It holds at most `burst` tokens and gains `rate` a second. A take may leave it below zero: the spec reader
charges a reading's seconds once the reading is done (its cost is known only then), and the caller waits
until the bucket is above zero again.
"""

from __future__ import annotations

import time


class TokenBucket:
    def __init__(self, rate: float, burst: float):
        if rate <= 0 or burst <= 0:
            raise ValueError(f"a token bucket needs rate > 0 and burst > 0, got rate {rate}, burst {burst}")
        self.rate, self.burst = rate, burst
        self._tokens = burst
        self._stamp = time.monotonic()

    def level(self) -> float:
        """The tokens held now (below zero while a take is being paid back)."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        return self._tokens

    def take(self, amount: float = 1.0) -> None:
        self._tokens = self.level() - amount

    def seconds_until(self, level: float) -> float:
        """How long until the bucket holds `level` tokens (0: it does now)."""
        return max(0.0, (level - self.level()) / self.rate)

    @property
    def full(self) -> bool:
        """Nothing taken that is not paid back: a bucket of a caller that went quiet, safe to forget."""
        return self.level() >= self.burst
