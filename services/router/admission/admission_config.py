"""Admission settings: the router's bounded queue, per-API-key rate limits and the TTFT SLO."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    # Requests between dispatch and their first token (router-wide); more wait in the queue.
    max_prefilling: int = 64
    max_queued: int = 256  # requests waiting for a dispatch slot
    max_queued_tokens: int = 262144  # their prompt tokens
    default_ttft_slo_s: float = 0.0  # 0: no target unless the request sets one
    prefill_tokens_per_s: float = 2000.0  # first guess of the prefill rate, until measured
    rate_limit_rps: float = 0.0  # per API key; 0: unlimited
    rate_limit_burst: float = 0.0  # 0: one second's worth (min 1)
    rate_limit_tokens_per_s: float = 0.0  # prompt + max tokens per key per second; 0: off
    queue_timeout_s: float = 60.0  # the longest a request waits in the queue
    # The highest x-priority a client without an API key gets (keys carry their own cap in
    # the key file); a higher header is lowered to it.
    max_priority: int = 0

    def __post_init__(self):
        if self.max_prefilling < 1:
            raise ValueError(f"max_prefilling must be >= 1, got {self.max_prefilling}")
        if self.max_queued < 0 or self.max_queued_tokens < 0:
            raise ValueError("max_queued and max_queued_tokens must be >= 0")
        if self.prefill_tokens_per_s <= 0 or self.queue_timeout_s <= 0:
            raise ValueError("prefill_tokens_per_s and queue_timeout_s must be > 0")
        if not -1000 <= self.max_priority <= 1000:
            raise ValueError(f"max_priority must be in [-1000, 1000], got {self.max_priority}")
        for name in ("default_ttft_slo_s", "rate_limit_rps", "rate_limit_burst",
                     "rate_limit_tokens_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
