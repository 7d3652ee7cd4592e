"""A per-instance circuit breaker: stop sending to an instance that keeps failing.

closed -> (`failures` consecutive failed calls) -> open: refuses for `open_s` -> half-open:
lets one call through; its success closes the breaker, its failure opens it again. Health
checks are separate (an instance can answer Health and still fail every request).
"""

from __future__ import annotations

import time
from typing import Callable


class CircuitBreaker:
    def __init__(self, failures: int, open_s: float, clock: Callable[[], float] = time.monotonic):
        if failures < 1 or open_s <= 0:
            raise ValueError("failures must be >= 1 and open_s > 0")
        self._threshold = failures
        self._open_s = open_s
        self._clock = clock
        self._failures = 0
        self._opened_at = None  # None: closed
        self._trial = False  # half-open and a trial call is out

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "open" if self._clock() - self._opened_at < self._open_s else "half_open"

    def allows(self) -> bool:
        state = self.state
        return state == "closed" or (state == "half_open" and not self._trial)

    def on_dispatch(self) -> None:
        if self.state == "half_open":
            self._trial = True

    def on_success(self) -> None:
        self._failures, self._opened_at, self._trial = 0, None, False

    def on_failure(self) -> bool:
        """Counts a failed call; True when this failure opened the breaker."""
        self._failures += 1
        state = self.state
        if state == "open":
            return False  # a call sent before it opened
        if state == "half_open" or self._failures >= self._threshold:
            self._opened_at, self._trial = self._clock(), False
            return True
        return False
