"""Per-API-key token buckets: requests per second and (prompt + max) tokens per second.

A bucket holds up to `burst` and refills at `rate` per second; taking more than it holds is
refused with the seconds until it would hold enough. Buckets are made on first use per key and
the least recently used are dropped beyond `max_keys` (a dropped key starts full again).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Optional


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst = rate, burst
        self.level, self._at = burst, now

    def take(self, amount: float, now: float) -> float:
        """0 when taken; else the seconds until `amount` would be there (nothing taken)."""
        self.level = min(self.burst, self.level + (now - self._at) * self.rate)
        self._at = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.burst:
            return float("inf")
        return (amount - self.level) / self.rate


class KeyedRateLimiter:
    def __init__(self, rps: float, burst: float, tokens_per_s: float, max_keys: int = 10000,
                 clock: Callable[[], float] = time.monotonic):
        self._rps, self._burst = rps, burst or max(1.0, rps)
        self._tps = tokens_per_s
        self._max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, tuple] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._rps > 0 or self._tps > 0

    def check(self, key: str, tokens: int) -> Optional[float]:
        """None when allowed (and charged); else the seconds to wait."""
        if not self.enabled:
            return None
        now = self._clock()
        req, tok = self._bucket(key, now)
        # A refused request must not be charged in the other bucket.
        wait_req = req.take(1, now) if req is not None else 0.0
        if wait_req:
            return wait_req
        wait_tok = tok.take(tokens, now) if tok is not None else 0.0
        if wait_tok:
            if req is not None:
                req.level += 1  # give the request back
            return wait_tok
        return None

    def _bucket(self, key: str, now: float) -> tuple:
        pair = self._buckets.pop(key, None)
        if pair is None:
            pair = (TokenBucket(self._rps, self._burst, now) if self._rps > 0 else None,
                    TokenBucket(self._tps, max(self._tps, 1.0), now) if self._tps > 0 else None)
        self._buckets[key] = pair
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
        return pair
