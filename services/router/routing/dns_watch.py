"""`--backends dns:NAME:PORT`: one instance per address NAME resolves to, re-resolved every
`interval_s` (a Kubernetes headless service lists its ready pods this way).

Lifecycle: `DnsWatcher(entries, pool).start()` resolves once and then periodically, handing
the addresses to `pool.sync("dns", ...)`; a failed lookup keeps the last answer. `stop()`
ends the task.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from pdserve.services.common.periodic import Periodic

log = logging.getLogger(__name__)
DNS_SCHEME = "dns:"


def split_dns(addresses: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """(plain host:port entries, (name, port) of the dns: entries)."""
    plain, dns = [], []
    for a in addresses:
        if a.startswith(DNS_SCHEME):
            name, _, port = a[len(DNS_SCHEME):].rpartition(":")
            dns.append((name, int(port)))
        else:
            plain.append(a)
    return tuple(plain), tuple(dns)


class DnsWatcher:
    def __init__(self, entries: tuple[tuple[str, int], ...], pool, interval_s: float = 5.0):
        self._entries = entries
        self._pool = pool
        self._interval_s = interval_s
        self._known: dict[tuple[str, int], set[str]] = {}
        self._periodic = Periodic(self.refresh, interval_s, "dns-watch")

    async def start(self) -> "DnsWatcher":
        await self._periodic.start()
        return self

    async def stop(self) -> None:
        await self._periodic.stop()

    async def refresh(self) -> None:
        loop = asyncio.get_running_loop()
        for name, port in self._entries:
            try:
                infos = await asyncio.wait_for(loop.getaddrinfo(
                    name, port, type=socket.SOCK_STREAM), self._interval_s)
            except (OSError, asyncio.TimeoutError) as exc:
                log.warning("cannot resolve %s (keeping %d addresses): %s", name,
                            len(self._known.get((name, port), ())), exc)
                continue
            self._known[(name, port)] = {_address(info[4], port) for info in infos}
        self._pool.sync("dns", set().union(*self._known.values()) if self._known else set())


def _address(sockaddr, port: int) -> str:
    host = sockaddr[0]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
