"""The measured prefill rate (prompt tokens per second, router-wide) behind the TTFT estimate.

Each first token is a sample: its prompt tokens over the busy time that produced them, i.e.
since the later of its own dispatch and the previous first token (with many requests in
flight, first tokens arrive at the system's throughput, not at one request's speed). An EWMA
smooths the samples; `initial` stands in until the first one.
"""

from __future__ import annotations

import time
from typing import Callable

_ALPHA = 0.3
_MIN_INTERVAL_S = 1e-3  # below timer noise a sample says nothing


class PrefillRate:
    def __init__(self, initial: float, clock: Callable[[], float] = time.monotonic):
        if initial <= 0:
            raise ValueError(f"initial rate must be > 0, got {initial}")
        self.tokens_per_s = initial
        self._clock = clock
        self._last_done = 0.0

    def observe(self, tokens: int, dispatched_at: float) -> None:
        now = self._clock()
        interval = now - max(dispatched_at, self._last_done)
        self._last_done = now
        if tokens <= 0 or interval < _MIN_INTERVAL_S:
            return
        sample = tokens / interval
        self.tokens_per_s += _ALPHA * (sample - self.tokens_per_s)

    def seconds_for(self, tokens: int) -> float:
        return tokens / self.tokens_per_s
