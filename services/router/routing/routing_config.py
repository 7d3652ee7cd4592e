"""Routing settings: which policy picks an instance for each role, and the KV-aware cost
function's weights (see cost.py for the function itself)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("round_robin", "least_load", "power_of_two", "kv_aware")


@dataclass(frozen=True)
class CostWeights:
    """Weights of the KV-aware cost; every term is in prompt-token units (see cost.py)."""

    store_hit: float = 0.8  # fraction of a block's compute saved by loading it from the store
    queue: float = 1.0  # per prompt token already queued on the instance
    running: float = 16.0  # per request the instance is running or has waiting
    kv_usage: float = 256.0  # at 100% KV usage (near preemption)
    # An instance running more than balance_abs requests beyond the least busy one, and more
    # than balance_rel times as many, is not a candidate: however much of the prompt it holds
    # (SGLang's cache-aware router has the same guard, at 32 and 1.1 for GPU batches; on a
    # CPU every running request slows each step, so the gap allowed is smaller).
    balance_abs: float = 4.0
    balance_rel: float = 1.5

    def __post_init__(self):
        if not 0.0 <= self.store_hit <= 1.0:
            raise ValueError(f"store_hit must be in [0, 1], got {self.store_hit}")
        if self.balance_rel < 1.0:
            raise ValueError(f"balance_rel must be >= 1, got {self.balance_rel}")
        for name in ("queue", "running", "kv_usage", "balance_abs"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost weight {name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class RoutingConfig:
    decode_policy: str = "kv_aware"  # decode (or unified) instances
    prefill_policy: str = "kv_aware"
    weights: CostWeights = CostWeights()
    session_affinity: bool = False  # same `user` / affinity header -> same instance
    affinity_header: str = "x-session-id"
    affinity_max_queue_tokens: int = 4096  # a busier sticky instance is left for the policy
    prefix_memory_blocks: int = 65536  # block keys remembered with the instance they went to

    def __post_init__(self):
        for name in ("decode_policy", "prefill_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name} must be one of {', '.join(POLICIES)}, "
                                 f"got {getattr(self, name)!r}")
        if not self.affinity_header:
            raise ValueError("affinity_header must be a header name")
        if self.affinity_max_queue_tokens < 0 or self.prefix_memory_blocks < 0:
            raise ValueError("affinity_max_queue_tokens and prefix_memory_blocks must be >= 0")
