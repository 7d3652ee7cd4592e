"""Registry settings. Engines take them from the environment (PDSERVE_REGISTRY_URL,
PDSERVE_ADVERTISE_ADDRESS, PDSERVE_REGISTRY_TTL_S, PDSERVE_REGISTRY_INTERVAL_S), which
`pdserve serve decode|prefill --registry ... --advertise-address ...` sets and which a
Kubernetes pod spec sets directly (the pod IP from the downward API)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

KEY_PREFIX = "pdserve:instance:"
ENV_URL, ENV_ADDRESS = "PDSERVE_REGISTRY_URL", "PDSERVE_ADVERTISE_ADDRESS"
ENV_TTL, ENV_INTERVAL = "PDSERVE_REGISTRY_TTL_S", "PDSERVE_REGISTRY_INTERVAL_S"


@dataclass(frozen=True)
class RegistryConfig:
    url: str  # redis://host:port/db
    ttl_s: float = 3.0  # an instance that stops heartbeating drops out after this
    interval_s: float = 1.0  # heartbeat (engines) and poll (routers) period
    key_prefix: str = KEY_PREFIX
    summary_blocks: int = 2048  # newest cached block keys an engine reports

    def __post_init__(self):
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"registry url must be redis://..., got {self.url!r}")
        if self.interval_s <= 0 or self.ttl_s <= self.interval_s:
            raise ValueError("registry interval_s must be > 0 and ttl_s > interval_s")
        if not self.key_prefix or self.summary_blocks < 0:
            raise ValueError("key_prefix must be set and summary_blocks >= 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Optional["RegistryConfig"]:
        """None when no registry is configured."""
        url = env.get(ENV_URL, "")
        if not url:
            return None
        return cls(url, ttl_s=float(env.get(ENV_TTL, 3.0)),
                   interval_s=float(env.get(ENV_INTERVAL, 1.0)))
