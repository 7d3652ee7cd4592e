"""What a routing policy sees of an instance and of a request, built per decision.

Policies are pure functions of these (plus their own counter or RNG), so unit tests drive them
with fake instances and the router with live ones alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Candidate:
    ref: object  # what the caller gets back: a Backend (or a test's stand-in)
    address: str
    active: int  # requests running or waiting there (reported, or the router's own count)
    queue_tokens: int  # prompt tokens queued there, not yet computed
    kv_usage: float = 0.0  # fraction of its KV blocks in use
    local_blocks: int = 0  # leading prompt blocks in its own prefix cache

    def __post_init__(self):
        if self.active < 0 or self.queue_tokens < 0 or self.local_blocks < 0:
            raise ValueError("active, queue_tokens and local_blocks must be >= 0")


@dataclass(frozen=True)
class RouteRequest:
    prompt_len: int = 0
    block_size: int = 0  # 0: the KV geometry is unknown (no blocks can be matched)
    store_blocks: int = 0  # leading prompt blocks the KV store holds
    affinity: Optional[str] = None  # session key: the same key goes to the same instance
