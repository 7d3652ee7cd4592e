"""What an engine service publishes in its heartbeat, read through its stats path.

EngineCore is not thread-safe; `AsyncEngine.stats()` is a snapshot the engine thread
replaces each step, and `cache_summary(core, n)` is meant to run on that thread too (the
engine service stores its result as `engine.cached_block_hashes`, a tuple it replaces, never
mutates). Without it the heartbeat simply reports no local cache.
"""

from __future__ import annotations

import socket
from typing import Callable

from pdserve.services.registry.heartbeat import Heartbeat
from pdserve.services.registry.record import PREFIX_BYTES, InstanceRecord


SUMMARY_BLOCKS = 2048  # ~16 KiB of summary per heartbeat
SUMMARY_PERIOD_S = 1.0


def cache_summary(core, limit: int = SUMMARY_BLOCKS) -> tuple:
    """The newest `limit` block keys in the engine's local prefix cache, shortened to
    PREFIX_BYTES. Engine thread only."""
    return tuple(k[:PREFIX_BYTES] for k in core.cached_block_hashes(limit))


def engine_record_fn(engine, address: str, role: str, model: str, fingerprint: str = "",
                     block_size: int = 0) -> Callable[[], InstanceRecord]:
    def snapshot() -> InstanceRecord:
        s = engine.stats()
        cached = frozenset(getattr(engine, "cached_block_hashes", ()) or ())
        return InstanceRecord(address, role, model, s.num_running, s.num_waiting,
                              s.num_waiting_tokens, min(1.0, max(0.0, s.kv_usage)), cached,
                              fingerprint, block_size)
    return snapshot


async def engine_heartbeat(cfg, engine, port: int):
    """Starts the heartbeat of an engine service when its config names a registry; None
    otherwise. `cfg`: its EngineServiceConfig (`cfg.registration`)."""
    reg = cfg.registration.registry_config()
    if reg is None:
        return None
    host = cfg.host
    if host in ("0.0.0.0", "::", ""):  # a wildcard is no address to dial
        host = socket.gethostbyname(socket.gethostname())
    address = cfg.registration.advertise_address or f"{host}:{port}"
    fingerprint = getattr(engine.core, "fingerprint", "") or ""
    snapshot = engine_record_fn(engine, address, cfg.role, cfg.model, fingerprint,
                                cfg.block_size)
    return await Heartbeat(reg, snapshot).start()
