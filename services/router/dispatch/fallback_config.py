"""Fallback-ladder settings: retries per rung, their backoff, and the circuit breaker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FallbackConfig:
    prefill_retries: int = 1  # other prefill instances tried after the first fails
    decode_retries: int = 1  # other decode instances tried while no token was streamed
    backoff_s: float = 0.05  # before retry k: backoff_s * 2**(k-1)
    breaker_failures: int = 3  # consecutive failed calls that open an instance's breaker
    breaker_open_s: float = 5.0  # how long an open breaker refuses, then lets one call try
    stream_idle_timeout_s: float = 120.0  # no message from an instance for this long: failed
    max_migrations: int = 3  # times one stream may move to another decode instance

    def __post_init__(self):
        if self.prefill_retries < 0 or self.decode_retries < 0:
            raise ValueError("prefill_retries and decode_retries must be >= 0")
        if self.backoff_s < 0 or self.breaker_open_s <= 0 or self.stream_idle_timeout_s <= 0:
            raise ValueError("backoff_s must be >= 0; breaker_open_s and "
                             "stream_idle_timeout_s > 0")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.breaker_failures < 1:
            raise ValueError(f"breaker_failures must be >= 1, got {self.breaker_failures}")
