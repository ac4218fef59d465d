"""A token bucket per key, for what a peer may send: the broker's calls per key and messages
per provider session, the provider's lines from an endpoint's engine."""

from __future__ import annotations

import time


class RateLimiter:
    """A token bucket per key: ``rate`` calls a second, bursts of ``burst``."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, key: str, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens (a call's share of the bucket) from ``key``'s bucket, if it
        has them."""
        if self.rate <= 0:
            return True
        now = time.monotonic()
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if len(self._buckets) > 100_000:   # forget full buckets: they would start full anyway
            self._buckets = {k: v for k, v in self._buckets.items()
                             if v[0] + (now - v[1]) * self.rate < self.burst}
        if tokens < cost:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - cost, now)
        return True
