"""The router side of the instance registry (services/registry): keeps the router's pools
equal to the live entries.

Lifecycle: `RegistryWatcher(cfg, pools).start()` reads the registry once and then
every `interval_s`: it SCANs the entries, hands each role's addresses to its pool
(`BackendPool.sync("registry", ...)`: new instances are health-checked at once and used as
soon as healthy, vanished ones retire) and copies each entry's cache summary onto its
Backend (not its load: the pool's own GetLoad is fresher, and a heartbeat's load up to an
interval old would count the router's own finished prefills as queued work). An entry expires `ttl_s` after its instance's last heartbeat, so a dead instance
leaves within ttl + interval (health checks usually mark it down sooner). While Redis is
unreachable the pools keep what they had. `stop()` ends the task and closes the connection.
An entry that does not parse (record.py validates types, ranges and size), or that names
another model than the router serves, is skipped with a warning (once per key and reason);
nothing an entry holds can end the watcher.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from pdserve.services.common.periodic import Periodic
from pdserve.services.registry.config import RegistryConfig
from pdserve.services.registry.record import InstanceRecord

log = logging.getLogger(__name__)
POOL_OF_ROLE = {"unified": "decode", "decode": "decode", "prefill": "prefill"}


class RegistryWatcher:
    def __init__(self, cfg: RegistryConfig, pools: dict, model: str = ""):
        """pools: {"decode": BackendPool, "prefill": BackendPool or None}; `model`: entries
        for another model are skipped ("" -> any)."""
        self.cfg = cfg
        self._model = model
        self._warned: set[tuple[bytes, str]] = set()
        self.skipped = 0  # entries skipped since start
        self._pools = {k: p for k, p in pools.items() if p is not None}
        self._redis = aioredis.from_url(cfg.url, socket_timeout=cfg.interval_s,
                                        socket_connect_timeout=cfg.interval_s)
        self._periodic = Periodic(self.refresh, cfg.interval_s, "registry-watch")
        self._healthy = True  # the last read worked (logs only the change)

    async def start(self) -> "RegistryWatcher":
        await self._periodic.start()
        return self

    async def stop(self) -> None:
        await self._periodic.stop()
        await self._redis.aclose()

    async def read(self) -> list[InstanceRecord]:
        keys = [k async for k in self._redis.scan_iter(match=self.cfg.key_prefix + "*",
                                                       count=500)]
        values = await self._redis.mget(keys) if keys else []
        records = []
        for key, value in zip(keys, values):
            if value is None:
                continue  # expired between SCAN and MGET
            try:
                record = InstanceRecord.from_json(value)
            except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
                self._skip(key, f"malformed: {exc}")
                continue
            if self._model and record.model and record.model != self._model:
                self._skip(key, f"serves model {record.model!r}, not {self._model!r}")
                continue
            records.append(record)
        return records

    def _skip(self, key: bytes, why: str) -> None:
        self.skipped += 1
        if (key, why) not in self._warned and len(self._warned) < 10000:
            self._warned.add((key, why))
            log.warning("registry entry %s skipped: %s", key[:200], why)

    async def refresh(self) -> bool:
        try:
            records = await self.read()
        except (aioredis.RedisError, OSError) as exc:
            if self._healthy:
                log.warning("registry unreachable, keeping the instances known: %s", exc)
            self._healthy = False
            return False
        self._healthy = True
        for kind, pool in self._pools.items():
            mine = [r for r in records if POOL_OF_ROLE[r.role] == kind]
            pool.sync("registry", {r.address for r in mine})
            for r in mine:  # load comes from the pool's own GetLoad (see Backend.observe)
                backend = pool.backend(r.address)
                if backend is not None:
                    backend.cache_summary = r.cached
        return True
