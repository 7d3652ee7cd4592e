"""The KV store master's semantics, without gRPC (master_service.py puts it on the wire).

Lifecycle: `MasterCore.start()` reloads nodes and objects from Redis and rebuilds the derived
in-memory state (one offset allocator per node, node -> keys index); every node found there
gets a fresh heartbeat grace period. Each call then changes memory and writes Redis before it
answers. `sweep()`, run periodically by the service, drops nodes that stopped heartbeating
(with their replicas) and revokes writes whose writer never ended them.

With store keys, every replica handed out carries a capability the master signs: a write grant
until the put's deadline with PutStart, a read grant for read_lease_s with each lookup.

One lock serializes the calls: the master is a metadata service and its calls are short, so
correctness beats parallelism here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from typing import Callable, Optional

from pdserve.connector.kvstore.auth import StoreKeys, sign_capability
from pdserve.connector.kvstore.node_protocol import READ, WRITE
from pdserve.services.kvstore.allocator import OffsetAllocator
from pdserve.services.kvstore.config import MasterConfig
from pdserve.services.kvstore.limits import check_lease
from pdserve.services.kvstore.metadata import RedisMetaStore
from pdserve.connector.kvstore.records import (NodeInfo, NodeUsage, ObjectMeta, ObjectState,
                                               PutStart, PutStatus, Replica, ReplicaList,
                                               StoreStats)

log = logging.getLogger(__name__)


class NodeConflict(RuntimeError):
    """A registration for a live node's id from another address."""
_EVICTION_SAMPLE = 16  # approximate LRU: the oldest of a random sample, as Redis does


class MasterCore:
    def __init__(self, cfg: MasterConfig, meta: RedisMetaStore,
                 clock: Callable[[], float] = time.time, keys: Optional[StoreKeys] = None):
        self._cfg = cfg
        self._keys = keys
        self._meta = meta
        self._clock = clock
        self._lock = asyncio.Lock()
        self._objects: dict[bytes, ObjectMeta] = {}
        self._nodes: dict[str, NodeInfo] = {}
        self._alloc: dict[str, OffsetAllocator] = {}
        self._node_keys: dict[str, set[bytes]] = {}
        self._last_beat: dict[str, float] = {}
        self._evictions = 0
        self._renewed: set[bytes] = set()  # keys whose read-renewed lease Redis lacks yet
        self._rng = random.Random(0)

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        now = self._clock()
        for node in await self._meta.load_nodes():
            self._add_node(node, now)
        stripped = []
        for meta in await self._meta.load_objects():
            live = tuple(r for r in meta.replicas if r.node_id in self._nodes)
            if not live:
                stripped.append(meta.key)
                continue
            meta = dataclasses.replace(meta, replicas=live)
            for r in live:
                self._alloc[r.node_id].reserve(r.offset, meta.size)
            self._index(meta)
        await self._meta.delete_objects(stripped)
        self._evictions = await self._meta.evictions()
        log.info("master loaded %d objects on %d nodes", len(self._objects), len(self._nodes))

    def _add_node(self, node: NodeInfo, now: float) -> None:
        self._nodes[node.node_id] = node
        self._alloc[node.node_id] = OffsetAllocator(node.capacity)
        self._node_keys[node.node_id] = set()
        self._last_beat[node.node_id] = now

    def _index(self, meta: ObjectMeta) -> None:
        self._objects[meta.key] = meta
        for r in meta.replicas:
            self._node_keys[r.node_id].add(meta.key)

    def _drop(self, key: bytes) -> None:
        meta = self._objects.pop(key)
        for r in meta.replicas:
            if r.node_id in self._nodes:
                self._alloc[r.node_id].free(r.offset)
                self._node_keys[r.node_id].discard(key)

    # ---- writes ------------------------------------------------------------------------

    async def put_start(self, key: bytes, size: int, lease_s: float,
                        replica_num: int = 0) -> PutStart:
        return (await self.put_start_many([(key, size, lease_s, replica_num)]))[0]

    async def put_start_many(self, entries: list[tuple[bytes, int, float, int]]
                             ) -> list[PutStart]:
        """PutStart for each (key, size, lease_s, replica_num), in order, as if called one
        after the other (a key twice: the second is WRITING, first writer wins); one Redis
        write for the whole batch. Every entry is checked before anything changes."""
        for _, size, lease_s, _ in entries:
            if size <= 0:
                raise ValueError("size must be positive")
            check_lease(lease_s, self._cfg)  # the edge checked too; NaN would never expire
        async with self._lock:
            evicted: list[bytes] = []
            started: list[ObjectMeta] = []
            results = [self._start_one(*e, evicted, started) for e in entries]
            await self._meta.delete_objects(evicted, evicted=len(evicted))
            await self._meta.save_objects(started)
            return results

    def _start_one(self, key: bytes, size: int, lease_s: float, replica_num: int,
                   evicted: list[bytes], started: list[ObjectMeta]) -> PutStart:
        """(Under _lock.) Place one put in memory; its record joins `started` and the objects
        it evicted join `evicted`, for the caller to write to Redis."""
        held = self._objects.get(key)
        if held is not None:  # first writer wins; the client waits out a WRITING one
            return PutStart(PutStatus.EXISTS if held.state is ObjectState.COMPLETE
                            else PutStatus.WRITING)
        want = replica_num or self._cfg.replica_num
        live = [n for n in self._nodes if self._alloc[n].capacity >= size]
        if len(live) < want:
            return PutStart(PutStatus.NOT_ENOUGH_NODES)
        replicas = self._place(size, want, live, evicted)
        if replicas is None:
            return PutStart(PutStatus.NO_SPACE)
        now = self._clock()
        meta = ObjectMeta(key, size, replicas, ObjectState.PROCESSING, now + lease_s, now,
                          now + self._cfg.put_timeout_s)
        self._index(meta)
        started.append(meta)
        return PutStart(PutStatus.OK, self._granted(replicas, WRITE, size, meta.put_deadline))

    def _granted(self, replicas: tuple[Replica, ...], op: bytes, size: int,
                 until: float) -> tuple[Replica, ...]:
        """The replicas, each with a capability for `op` on its range until `until`."""
        if self._keys is None:
            return replicas
        return tuple(dataclasses.replace(r, capability=sign_capability(
            self._keys.grant, op, r.node_id, r.offset, size, until)) for r in replicas)

    def _place(self, size, want, live, evicted) -> tuple[Replica, ...] | None:
        """`want` replicas on distinct nodes, emptiest first; None (nothing held) if no room."""
        placed: list[Replica] = []
        for node_id in sorted(live, key=lambda n: -self._alloc[n].free_bytes):
            offset = self._allocate_on(node_id, size, evicted)
            if offset is not None:
                placed.append(Replica(node_id, self._nodes[node_id].address, offset))
                if len(placed) == want:
                    return tuple(placed)
        for r in placed:
            self._alloc[r.node_id].free(r.offset)
        return None

    def _allocate_on(self, node_id: str, size: int, evicted: list[bytes]) -> int | None:
        alloc = self._alloc[node_id]
        offset = alloc.allocate(size)
        while offset is None and self._evict_one(node_id, evicted):
            offset = alloc.allocate(size)
        if offset is not None and alloc.used_bytes > self._cfg.high_watermark * alloc.capacity:
            while (alloc.used_bytes > self._cfg.low_watermark * alloc.capacity
                   and self._evict_one(node_id, evicted)):
                pass
        return offset

    def _evict_one(self, node_id: str, evicted: list[bytes]) -> bool:
        """Evict the least recently used unleased complete object on the node, if any."""
        now = self._clock()
        keys = self._node_keys[node_id]
        sample = self._rng.sample(tuple(keys), min(_EVICTION_SAMPLE, len(keys)))
        victim = self._oldest_evictable(sample, now) or self._oldest_evictable(keys, now)
        if victim is None:
            return False
        self._drop(victim)
        evicted.append(victim)
        self._evictions += 1
        return True

    def _oldest_evictable(self, keys, now: float) -> bytes | None:
        best = None
        for k in keys:
            m = self._objects[k]
            if m.state is ObjectState.COMPLETE and m.lease_until <= now and (
                    best is None or m.last_access < best.last_access):
                best = m
        return None if best is None else best.key

    async def put_end(self, key: bytes) -> bool:
        return (await self.put_end_many([key]))[0]

    async def put_end_many(self, keys: list[bytes]) -> list[bool]:
        """PutEnd for each key, in order (False: not being written); one Redis write."""
        async with self._lock:
            now, ended, ok = self._clock(), [], []
            for key in keys:
                meta = self._objects.get(key)
                ok.append(meta is not None and meta.state is ObjectState.PROCESSING)
                if ok[-1]:
                    meta = dataclasses.replace(meta, state=ObjectState.COMPLETE, last_access=now)
                    self._objects[key] = meta
                    ended.append(meta)
            await self._meta.save_objects(ended)
            return ok

    async def put_revoke(self, key: bytes) -> bool:
        return (await self.put_revoke_many([key]))[0]

    async def put_revoke_many(self, keys: list[bytes]) -> list[bool]:
        """PutRevoke for each key, in order: a write in progress is dropped and its space
        freed (False: not being written); one Redis write."""
        async with self._lock:
            ok = []
            for key in keys:
                meta = self._objects.get(key)
                ok.append(meta is not None and meta.state is ObjectState.PROCESSING)
                if ok[-1]:
                    self._drop(key)
            await self._meta.delete_objects([k for k, good in zip(keys, ok) if good])
            return ok

    async def remove(self, keys: list[bytes], force: bool = False) -> int:
        async with self._lock:
            now = self._clock()
            gone = [k for k in dict.fromkeys(keys) if (m := self._objects.get(k)) is not None
                    and m.state is ObjectState.COMPLETE and (force or m.lease_until <= now)]
            for k in gone:
                self._drop(k)
            await self._meta.delete_objects(gone)
            return len(gone)

    # ---- reads -------------------------------------------------------------------------

    async def get_replicas(self, key: bytes) -> ReplicaList | None:
        """Where a complete object lives; renews its lease so the read can finish."""
        return (await self.get_replicas_many([key]))[0]

    async def get_replicas_many(self, keys: list[bytes]) -> list[ReplicaList | None]:
        """`get_replicas` for each key (None for a miss or an object still being written);
        the renewed leases go to the metadata store with the next flush_renewals."""
        async with self._lock:
            now = self._clock()
            found: list[ReplicaList | None] = []
            renewed = []
            for key in keys:
                meta = self._objects.get(key)
                if meta is None or meta.state is not ObjectState.COMPLETE:
                    found.append(None)
                    continue
                meta = dataclasses.replace(
                    meta, last_access=now,
                    lease_until=max(meta.lease_until, now + self._cfg.read_lease_s))
                self._objects[key] = meta
                renewed.append(meta)
                found.append(ReplicaList(meta.size, self._granted(
                    meta.replicas, READ, meta.size, now + self._cfg.read_lease_s)))
            # Renewals stay in memory until the next sweep writes them: a read needs no Redis
            # round trip, and works while Redis is down (they are written once it is back).
            self._renewed.update(m.key for m in renewed)
            return found

    async def flush_renewals(self) -> None:
        """Write the leases renewed by reads since the last flush; on a Redis error they stay
        pending (and the error propagates) for the next try."""
        async with self._lock:
            keys, self._renewed = self._renewed, set()
            metas = [self._objects[k] for k in keys if k in self._objects]
            try:
                await self._meta.save_objects(metas)
            except BaseException:
                self._renewed |= keys
                raise

    def _complete(self, key: bytes) -> bool:
        meta = self._objects.get(key)
        return meta is not None and meta.state is ObjectState.COMPLETE

    def batch_exists(self, keys: list[bytes]) -> list[bool]:
        return [self._complete(k) for k in keys]

    def prefix_lookup(self, keys: list[bytes]) -> int:
        for i, k in enumerate(keys):
            if not self._complete(k):
                return i
        return len(keys)

    def stats(self) -> StoreStats:
        return StoreStats(
            objects=len(self._objects), evictions=self._evictions,
            nodes=tuple(NodeUsage(n.node_id, n.address, n.capacity,
                                  self._alloc[n.node_id].used_bytes)
                        for n in self._nodes.values()))

    # ---- nodes -------------------------------------------------------------------------

    async def register_node(self, node: NodeInfo) -> None:
        async with self._lock:
            old = self._nodes.get(node.node_id)
            if old is not None and old == node:
                self._last_beat[node.node_id] = self._clock()
                return  # a repeated registration of the same incarnation
            if old is not None and old.address != node.address and self._alive(node.node_id):
                # a live node's id claimed from elsewhere: refuse, keep the node and its objects
                raise NodeConflict(f"node {node.node_id} is live at {old.address}")
            if old is not None:  # a restarted node: its segment, and so its replicas, are new
                await self._drop_node(node.node_id)
            self._add_node(node, self._clock())
            await self._meta.save_node(node)
            log.info("node %s registered at %s (%d bytes)", node.node_id, node.address,
                     node.capacity)

    def _alive(self, node_id: str) -> bool:
        return self._clock() - self._last_beat[node_id] <= self._cfg.node_timeout_s

    def heartbeat(self, node_id: str, incarnation: str) -> bool:
        node = self._nodes.get(node_id)
        if node is None or node.incarnation != incarnation:
            return False
        self._last_beat[node_id] = self._clock()
        return True

    async def sweep(self) -> None:
        async with self._lock:
            now = self._clock()
            for node_id in [n for n, t in self._last_beat.items()
                            if now - t > self._cfg.node_timeout_s]:
                log.warning("node %s missed its heartbeats; dropping it", node_id)
                await self._drop_node(node_id)
            stale = [k for k, m in self._objects.items()
                     if m.state is ObjectState.PROCESSING and m.put_deadline <= now]
            for k in stale:
                self._drop(k)
            await self._meta.delete_objects(stale)

    async def _drop_node(self, node_id: str) -> None:
        """Forget a node; objects keep their other replicas or go."""
        keys = self._node_keys.pop(node_id)
        del self._nodes[node_id], self._alloc[node_id], self._last_beat[node_id]
        kept, gone = [], []
        for k in keys:
            meta = self._objects[k]
            rest = tuple(r for r in meta.replicas if r.node_id != node_id)
            if rest:
                kept.append(dataclasses.replace(meta, replicas=rest))
                self._objects[k] = kept[-1]
            else:
                self._drop(k)
                gone.append(k)
        await self._meta.save_objects(kept)
        await self._meta.delete_objects(gone)
        await self._meta.delete_node(node_id)
