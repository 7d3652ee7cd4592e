"""Redis persistence of the master's state: objects, nodes and the eviction counter.

The master is the only writer and keeps the same records in memory; every change is written
here before the master answers, so a restarted master reloads exactly what it had promised.

Layout under `namespace`: `<ns>:obj:<key>` a hash per object; `<ns>:nodes` a hash of node id
-> JSON; `<ns>:evictions` a counter.
"""

from __future__ import annotations

import json

from pdserve.connector.kvstore.records import NodeInfo, ObjectMeta, ObjectState, Replica


def _encode(meta: ObjectMeta) -> dict[str, str]:
    return {
        "size": str(meta.size),
        "state": meta.state.value,
        "replicas": json.dumps([[r.node_id, r.address, r.offset] for r in meta.replicas]),
        "lease_until": repr(meta.lease_until),
        "last_access": repr(meta.last_access),
        "put_deadline": repr(meta.put_deadline),
    }


def _decode(key: bytes, h: dict[bytes, bytes]) -> ObjectMeta:
    return ObjectMeta(
        key=key, size=int(h[b"size"]), state=ObjectState(h[b"state"].decode()),
        replicas=tuple(Replica(n, a, int(o)) for n, a, o in json.loads(h[b"replicas"])),
        lease_until=float(h[b"lease_until"]), last_access=float(h[b"last_access"]),
        put_deadline=float(h[b"put_deadline"]))


class RedisMetaStore:
    def __init__(self, redis, namespace: str):
        self._r = redis  # a redis.asyncio.Redis (bytes responses)
        self._obj_prefix = f"{namespace}:obj:".encode()
        self._nodes = f"{namespace}:nodes"
        self._evictions = f"{namespace}:evictions"

    async def save_objects(self, metas: list[ObjectMeta]) -> None:
        if not metas:
            return
        async with self._r.pipeline(transaction=True) as pipe:
            for meta in metas:
                pipe.hset(self._obj_prefix + meta.key, mapping=_encode(meta))
            await pipe.execute()

    async def delete_objects(self, keys: list[bytes], evicted: int = 0) -> None:
        if not keys:
            return
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.delete(*(self._obj_prefix + k for k in keys))
            if evicted:
                pipe.incrby(self._evictions, evicted)
            await pipe.execute()

    async def load_objects(self) -> list[ObjectMeta]:
        names = [n async for n in self._r.scan_iter(match=self._obj_prefix + b"*", count=1000)]
        async with self._r.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(name)
            hashes = await pipe.execute()
        cut = len(self._obj_prefix)
        return [_decode(name[cut:], h) for name, h in zip(names, hashes) if h]

    async def save_node(self, node: NodeInfo) -> None:
        await self._r.hset(self._nodes, node.node_id, json.dumps(
            {"address": node.address, "capacity": node.capacity,
             "incarnation": node.incarnation}))

    async def delete_node(self, node_id: str) -> None:
        await self._r.hdel(self._nodes, node_id)

    async def load_nodes(self) -> list[NodeInfo]:
        raw = await self._r.hgetall(self._nodes)
        return [NodeInfo(node_id=k.decode(), **json.loads(v)) for k, v in raw.items()]

    async def evictions(self) -> int:
        return int(await self._r.get(self._evictions) or 0)
