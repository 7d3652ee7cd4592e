"""The engine side of the registry: a task that keeps this instance's entry alive.

Lifecycle: `Heartbeat(cfg, snapshot).start()` writes the entry at once and then every
`interval_s`, each write with a TTL of `ttl_s`, so a crashed instance drops out by itself;
`stop()` ends the task and deletes the entry (a clean shutdown leaves at once). A failed
write (Redis down) is logged and retried on the next beat; the instance keeps serving.
`snapshot()` returns the InstanceRecord to publish (engine_snapshot.py builds one from an
engine service's stats).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import redis.asyncio as aioredis

from pdserve.services.common.periodic import Periodic
from pdserve.services.registry.config import RegistryConfig
from pdserve.services.registry.record import InstanceRecord

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, cfg: RegistryConfig, snapshot: Callable[[], InstanceRecord]):
        self.cfg = cfg
        self._snapshot = snapshot
        self._redis = aioredis.from_url(cfg.url, socket_timeout=cfg.interval_s,
                                        socket_connect_timeout=cfg.interval_s)
        self._periodic = Periodic(self.beat, cfg.interval_s, "registry-heartbeat")
        self._key: Optional[str] = None
        self.beats = 0  # successful writes

    async def start(self) -> "Heartbeat":
        await self._periodic.start()
        return self

    async def beat(self) -> bool:
        try:
            record = self._snapshot()
            self._key = self.cfg.key_prefix + record.address
            await self._redis.set(self._key, record.to_json(), px=int(self.cfg.ttl_s * 1000))
        except (aioredis.RedisError, OSError, ValueError) as exc:
            log.warning("registry heartbeat failed: %s", exc)
            return False
        self.beats += 1
        return True

    async def stop(self) -> None:
        """Deregisters: ends the beats and deletes the entry (routers drop it on their next
        read)."""
        await self._periodic.stop()
        if self._key is not None:
            try:
                await self._redis.delete(self._key)
            except (aioredis.RedisError, OSError) as exc:
                log.warning("registry entry not removed (it expires): %s", exc)
        await self._redis.aclose()
