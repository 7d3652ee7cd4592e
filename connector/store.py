"""What the connector needs from a KV store, and an in-process store for tests.

The real implementation is the Mooncake-style store's client (connector/kvstore/client.py,
injected by the services, so connector/ never imports services/). Its contract: a miss is a
return value (None / 0); an unreachable store raises.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Optional, Protocol, Sequence


STORED = ("ok", "exists")  # put statuses that leave the object readable


def put_stored(status) -> bool:
    """True when a put's status (an enum with string values, or a string) means the object
    is in the store, whoever wrote it; NO_SPACE, NOT_ENOUGH_NODES, REVOKED... mean it is not."""
    return getattr(status, "value", status) in STORED


class BlockStore(Protocol):
    async def put(self, key: bytes, data: memoryview, lease_s: float = 0.0):
        """Store data under key; returns a status (see put_stored)."""

    async def put_many(self, items: Sequence[tuple[bytes, memoryview]], lease_s: float = 0.0,
                       ready: Optional[Sequence[Awaitable]] = None) -> list:
        """Store each (key, data) (a step's objects: one batch, not a round trip each). Per
        item, in order: a status (see put_stored) or the exception that failed it. `ready[i]`,
        when given, is awaited before item i's bytes are read (its header is being written)."""

    async def get_many_into(self, keys: list[bytes], outs: list[memoryview],
                            max_inflight: int = 8) -> list:
        """Read each key's object into its buffer, one lookup for all of them (a whole load).
        Per key: its size, None on a miss, or the exception its read raised; raises when
        the store is unreachable."""

    async def prefix_lookup(self, keys: list[bytes]) -> int: ...


class InMemoryBlockStore:
    """A dict behind the BlockStore protocol, with failure switches for tests."""

    def __init__(self):
        self.objects: dict[bytes, bytes] = {}
        self.down = False  # every call raises, like an unreachable store
        self.delay_s = 0.0
        self.puts = 0
        self.gets = 0
        self.batch_gets = 0

    def _check(self):
        if self.down:
            raise ConnectionError("store is down")

    async def put(self, key, data, lease_s=0.0):
        self._check()
        await asyncio.sleep(self.delay_s)
        self.puts += 1
        self.objects.setdefault(key, bytes(data))
        return "ok"

    async def put_many(self, items, lease_s=0.0, ready=None):
        """Each item through `put` (tests replace `put` to inject failures)."""
        async def one(i, key, data):
            if ready is not None:
                await ready[i]
            return await self.put(key, data, lease_s)
        return list(await asyncio.gather(*(one(i, k, d) for i, (k, d) in enumerate(items)),
                                         return_exceptions=True))

    async def get_many_into(self, keys, outs, max_inflight=8):
        self._check()
        self.batch_gets += 1
        return list(await asyncio.gather(*(self.get_into(k, o) for k, o in zip(keys, outs)),
                                         return_exceptions=True))

    async def get_into(self, key, out):
        self._check()
        await asyncio.sleep(self.delay_s)
        self.gets += 1
        data = self.objects.get(key)
        if data is None:
            return None
        memoryview(out)[:len(data)] = data
        return len(data)

    async def prefix_lookup(self, keys):
        self._check()
        n = 0
        for k in keys:
            if k not in self.objects:
                break
            n += 1
        return n
