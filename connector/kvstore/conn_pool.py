"""A few transport connections per storage node, reused across requests.

A transport connection carries one request at a time, so parallel transfers to one node need
several; a connection that failed is dropped, not returned. Connecting has a deadline: a node
that does not accept within it counts as down.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from pdserve.connector.transport import Connection, RemoteError, Transport, TransportError


class _NodeConns:
    def __init__(self, limit: int):
        self.idle: list[Connection] = []
        self.slots = asyncio.Semaphore(limit)


class ConnectionPool:
    def __init__(self, transport: Transport, per_node: int = 4, connect_timeout_s: float = 2.0):
        if per_node < 1:
            raise ValueError("per_node must be >= 1")
        self._transport = transport
        self._per_node = per_node
        self._connect_timeout_s = connect_timeout_s
        self._nodes: dict[str, _NodeConns] = {}

    async def _connect(self, addr: str) -> Connection:
        try:
            return await asyncio.wait_for(self._transport.connect(addr), self._connect_timeout_s)
        except asyncio.TimeoutError:
            raise TransportError(f"connect to {addr} timed out after "
                                 f"{self._connect_timeout_s} s") from None

    @asynccontextmanager
    async def connection(self, addr: str):
        node = self._nodes.setdefault(addr, _NodeConns(self._per_node))
        async with node.slots:
            while node.idle and not node.idle[-1].usable:  # broken while idle, or by its peer
                await node.idle.pop().close()
            conn = node.idle.pop() if node.idle else await self._connect(addr)
            try:
                yield conn
            except RemoteError:  # the peer answered (refused): the stream is in step
                self._put_back(node, conn)
                raise
            except BaseException:
                await conn.close()  # mid-request state is unknown: never reuse it
                raise
            self._put_back(node, conn)

    @staticmethod
    def _put_back(node: _NodeConns, conn: Connection) -> None:
        if conn.usable:
            node.idle.append(conn)

    async def close(self) -> None:
        for node in self._nodes.values():
            for conn in node.idle:
                await conn.close()
        self._nodes.clear()
