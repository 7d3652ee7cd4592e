"""The KV store client (the one engines and the router use): metadata calls to the master over
gRPC, bytes to and from storage nodes over the KV transport.

A put is PutStart (the master places each replica: node + offset, with a write capability) ->
write the bytes to every replica in parallel -> PutEnd; if a write fails or the put passes its
deadline, PutRevoke, so readers never see a half-written object and the master frees its space
at once. `put_many` does the same for many objects with one BatchPutStart, each node's
writes pipelined on one connection, and one BatchPutEnd (batch_put.py). A get asks for the
replica list (which renews the object's lease and hands out read
capabilities) and reads from the first replica that answers. A miss is a return value (None /
PutStatus); an unreachable or too slow master or storage node raises `KVStoreUnavailable`.
A put that finds its key complete answers EXISTS; one that finds it still being written waits
for it and answers EXISTS only once that object is readable, takes the key over and writes
it itself if that object goes away (its writer revoked), else answers UNSETTLED after
`settle_timeout_s` (batch_put.py, `settle_writing`).

Deadlines (StoreClientConfig): every master call has `lookup_timeout_s`, every node connect
`connect_timeout_s`, a whole put `put_timeout_s`, a whole read `get_timeout_s`.

With block keys (the block secret, auth.py) every key a caller passes is a block hash and the
store sees only its keyed hash: nobody without the secret can predict, squat on or probe it.

Lifecycle: construct on the event loop that will use it (grpc.aio channels bind to it); the
transport is created on the first transfer (a metadata-only user, the router, never makes
one); `close()` closes the pool and the channel.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence

import grpc

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.connector.kvstore import convert
from pdserve.connector.kvstore.batch_put import MasterCalls, put_batch
from pdserve.connector.kvstore.auth import (UNKEYED_MAC_KEY, BlockKeys, StoreKeys,
                                            load_block_keys, remove_body, sign_token)
from pdserve.connector.kvstore.conn_pool import ConnectionPool
from pdserve.connector.kvstore.errors import KVStoreUnavailable
from pdserve.connector.kvstore.node_protocol import READ, WRITE, NodeOp
from pdserve.connector.kvstore.records import PutStatus, Replica, ReplicaList, StoreStats
from pdserve.connector.transport import (TRANSPORT_KINDS, RemoteError, Transport,
                                         TransportError, make_transport)
from pdserve.connector.transport.base import Buffer, as_bytes_view

log = logging.getLogger(__name__)

ChannelFactory = Callable[[str], grpc.aio.Channel]  # master address -> channel (TLS or not)
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass(frozen=True)
class StoreClientConfig:
    transport: str = "auto"  # auto | ucx | tcp, to reach the storage nodes
    connect_timeout_s: float = 2.0  # a storage node that does not accept by then is down
    lookup_timeout_s: float = 2.0  # every master call (lookups, PutStart/End, ...)
    put_timeout_s: float = 10.0  # a whole put; past it the put is revoked
    get_timeout_s: float = 10.0  # a whole read of one object (all replicas tried)
    # the longest a put waits for another writer's object under its key to become readable
    # (PutStart said WRITING: another put still writes it); then UNSETTLED, not stored. If
    # that object goes away meanwhile (revoked), the put takes the key over and writes it
    settle_timeout_s: float = 1.0
    conns_per_node: int = 4
    # objects per BatchPutStart of put_many (more go in several batches, one after the
    # other); the master refuses batches over its max_batch_puts (1,024 by default)
    put_batch: int = 256
    block_secret_file: str = ""  # "" -> $PDSERVE_KV_BLOCK_SECRET_FILE; neither -> raw keys

    def __post_init__(self):
        if self.transport not in TRANSPORT_KINDS:
            raise ValueError(f"transport must be one of {TRANSPORT_KINDS}, got "
                             f"{self.transport!r}")
        for name in ("connect_timeout_s", "lookup_timeout_s", "put_timeout_s",
                     "get_timeout_s", "settle_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be positive and finite, got "
                                 f"{getattr(self, name)}")
        if self.conns_per_node < 1:
            raise ValueError("conns_per_node must be >= 1")
        if self.put_batch < 1:
            raise ValueError("put_batch must be >= 1")


class KVStoreClient:
    def __init__(self, master_addr: str, transport: Transport | str | None = None, *,
                 config: StoreClientConfig = StoreClientConfig(),
                 block_keys: Optional[BlockKeys] = None,
                 store_keys: Optional[StoreKeys] = None,
                 open_channel: ChannelFactory = grpc.aio.insecure_channel):
        """`transport` overrides config.transport (a kind, or a Transport object);
        `block_keys` map every key (see the module doc); `store_keys` are needed only for
        admin calls (remove) on a master that has a store secret; `open_channel(address)`
        makes the channel to the master (the services pass one with mutual TLS)."""
        self.config = config
        self.master_addr = master_addr
        self._transport_arg = transport if transport is not None else config.transport
        self._transport: Optional[Transport] = None
        self._pool: Optional[ConnectionPool] = None
        self._channel = open_channel(master_addr)
        self._stub = pb_grpc.KVStoreMasterStub(self._channel)
        self._block_keys = block_keys
        self._store_keys = store_keys
        self._revokes: set[asyncio.Task] = set()  # revokes of puts cancelled by their caller

    @classmethod
    def for_engines(cls, master_addr: str, config: StoreClientConfig,
                    open_channel: ChannelFactory = grpc.aio.insecure_channel) -> "KVStoreClient":
        """A client with the block keys from config.block_secret_file (or its env var)."""
        return cls(master_addr, config=config,
                   block_keys=load_block_keys(config.block_secret_file),
                   open_channel=open_channel)

    @property
    def mac_key(self) -> bytes:
        """The block MAC key the codec signs and checks with (a public one without keys)."""
        return UNKEYED_MAC_KEY if self._block_keys is None else self._block_keys.mac

    def _connections(self) -> ConnectionPool:
        if self._pool is None:
            t = self._transport_arg
            self._transport = make_transport(t) if isinstance(t, str) else t
            self._pool = ConnectionPool(self._transport, self.config.conns_per_node,
                                        self.config.connect_timeout_s)
        return self._pool

    async def close(self) -> None:
        if self._revokes:
            await asyncio.gather(*self._revokes, return_exceptions=True)
        if self._pool is not None:
            await self._pool.close()
        await self._channel.close()

    async def __aenter__(self) -> "KVStoreClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _k(self, key: bytes) -> bytes:
        return key if self._block_keys is None else self._block_keys.object_key(key)

    def _ks(self, keys: list[bytes]) -> list[bytes]:
        return keys if self._block_keys is None else [self._block_keys.object_key(k)
                                                      for k in keys]

    async def _call(self, rpc, request):
        try:
            return await rpc(request, timeout=self.config.lookup_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from exc
            if exc.code() in _UNAVAILABLE:
                raise KVStoreUnavailable(
                    f"kvstore master {self.master_addr}: {exc.code().name} {exc.details()}"
                ) from exc
            raise

    # ---- writes ------------------------------------------------------------------------

    async def put(self, key: bytes, data: Buffer, lease_s: float = 0.0,
                  replica_num: int = 0) -> PutStatus:
        """Store data under key, within put_timeout_s (then revoked: KVStoreUnavailable)."""
        view = as_bytes_view(data)
        if not len(view):
            raise ValueError("cannot store an empty object")
        skey = self._k(key)
        deadline = time.monotonic() + self.config.put_timeout_s
        started = convert.put_start_from_pb(await self._call(
            self._stub.PutStart, pb.PutStartRequest(key=skey, size=len(view), lease_s=lease_s,
                                                    replica_num=replica_num)))
        if started.status is PutStatus.WRITING:  # wait for its writer, or take the key over
            result = (await put_batch(
                MasterCalls(self._call, self._stub, self._revokes), self._connections(),
                [skey], [view], lease_s, replica_num, max(deadline - time.monotonic(), 0.001),
                settle_s=self.config.settle_timeout_s))[0]
            if isinstance(result, BaseException):
                raise result
            return result
        if started.status is not PutStatus.OK:
            return started.status
        writes = asyncio.gather(*(self._write(r, view) for r in started.replicas))
        try:
            await asyncio.wait_for(writes, max(deadline - time.monotonic(), 0.001))
        except asyncio.CancelledError:  # the caller gave up: revoke without holding it
            task = asyncio.get_running_loop().create_task(self._revoke_quietly(skey))
            self._revokes.add(task)
            task.add_done_callback(self._revokes.discard)
            raise
        except BaseException as exc:
            await self._revoke_quietly(skey)
            if isinstance(exc, asyncio.TimeoutError):
                raise KVStoreUnavailable(f"put timed out after "
                                         f"{self.config.put_timeout_s} s; revoked") from None
            raise
        ended = await self._call(self._stub.PutEnd, pb.PutEndRequest(key=skey))
        return PutStatus.OK if ended.ok else PutStatus.REVOKED

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]], lease_s: float = 0.0,
                       replica_num: int = 0, ready: Optional[Sequence[Awaitable]] = None
                       ) -> list:
        """Store each (key, data) as `put` does, with two master calls per put_batch objects
        and each node's writes pipelined on one connection (batch_put.py). Per item, in
        order: a PutStatus, or the KVStoreUnavailable that failed it (revoked). `ready[i]`:
        awaited before item i's bytes go out (its header may be written until then). An
        unreachable master fails the items of the batches it did not start."""
        views = [as_bytes_view(d) for _, d in items]
        if any(not len(v) for v in views):
            raise ValueError("cannot store an empty object")
        master = MasterCalls(self._call, self._stub, self._revokes)
        results: list = []
        step = self.config.put_batch
        for at in range(0, len(items), step):
            keys = [self._k(k) for k, _ in items[at:at + step]]
            part = None if ready is None else ready[at:at + step]
            try:
                results += await put_batch(master, self._connections(), keys,
                                           views[at:at + step], lease_s, replica_num,
                                           self.config.put_timeout_s, part,
                                           settle_s=self.config.settle_timeout_s)
            except KVStoreUnavailable as exc:
                results += [exc] * len(keys)
        return results

    async def _write(self, replica: Replica, view: memoryview) -> None:
        header = NodeOp(WRITE, replica.offset, len(view), replica.capability).encode()
        try:
            async with self._connections().connection(replica.address) as conn:
                await conn.request(header, view)
        except (TransportError, RemoteError) as exc:
            raise KVStoreUnavailable(f"write to node {replica.node_id} failed: {exc}") from exc

    async def _revoke_quietly(self, skey: bytes) -> None:
        try:  # best effort: if the master is gone too, its put timeout reclaims the space
            await self._call(self._stub.PutRevoke, pb.PutRevokeRequest(key=skey))
        except KVStoreUnavailable as exc:
            log.warning("PutRevoke failed (%s); the master's put timeout will reclaim it", exc)

    async def remove(self, keys: list[bytes], force: bool = False) -> int:
        """An admin call: needs the store keys when the master has a store secret."""
        skeys = self._ks(keys)
        req = pb.RemoveRequest(keys=skeys, force=force)
        if self._store_keys is not None:
            req.auth = sign_token(self._store_keys.admin, b"remove", remove_body(skeys, force),
                                  time.time())
        return (await self._call(self._stub.Remove, req)).removed

    # ---- reads -------------------------------------------------------------------------

    async def replicas(self, key: bytes) -> ReplicaList | None:
        return convert.replica_list_from_pb(await self._call(
            self._stub.GetReplicaList, pb.GetReplicaListRequest(key=self._k(key))))

    async def replicas_many(self, keys: list[bytes]) -> list[ReplicaList | None]:
        resp = await self._call(self._stub.BatchGetReplicaList,
                                pb.BatchGetReplicaListRequest(keys=self._ks(keys)))
        if len(resp.lists) != len(keys):
            raise KVStoreUnavailable("master answered a lookup with the wrong count")
        return [convert.replica_list_from_pb(m) for m in resp.lists]

    async def get_many_into(self, keys: list[bytes], outs: list[Buffer],
                            max_inflight: int = 8) -> list:
        """Read several objects straight into their buffers: one replica lookup for all of
        them, then up to `max_inflight` reads at a time. Per key, in order: its size, None on a
        miss, or the exception its read raised. An unreachable master raises."""
        found = await self.replicas_many(keys)
        sem = asyncio.Semaphore(max_inflight)

        async def one(rl: ReplicaList | None, out: Buffer) -> int | None:
            if rl is None:
                return None
            view = as_bytes_view(out)
            if len(view) < rl.size:
                raise ValueError(f"out holds {len(view)} bytes, the object has {rl.size}")
            async with sem:
                await self._read(rl, view[:rl.size])
            return rl.size
        return await asyncio.gather(*(one(rl, o) for rl, o in zip(found, outs)),
                                    return_exceptions=True)

    async def get(self, key: bytes) -> bytes | None:
        found = await self.replicas(key)
        if found is None:
            return None
        buf = bytearray(found.size)
        await self._read(found, memoryview(buf))
        return bytes(buf)

    async def get_into(self, key: bytes, out: Buffer) -> int | None:
        """Read the object straight into `out` (no copy); its size, or None on a miss."""
        found = await self.replicas(key)
        if found is None:
            return None
        view = as_bytes_view(out)
        if len(view) < found.size:
            raise ValueError(f"out holds {len(view)} bytes, the object has {found.size}")
        await self._read(found, view[:found.size])
        return found.size

    async def _read(self, found: ReplicaList, out: memoryview) -> None:
        try:
            await asyncio.wait_for(self._read_any(found, out), self.config.get_timeout_s)
        except asyncio.TimeoutError:
            raise KVStoreUnavailable(f"read timed out after {self.config.get_timeout_s} s"
                                     ) from None

    async def _read_any(self, found: ReplicaList, out: memoryview) -> None:
        errors = []
        for r in found.replicas:
            try:
                async with self._connections().connection(r.address) as conn:
                    msg = await conn.request(
                        NodeOp(READ, r.offset, found.size, r.capability).encode(), out=out)
                if len(msg.payload) == len(out):  # then it landed in `out`
                    return
                errors.append(f"{r.node_id}: answered {len(msg.payload)} bytes")
            except (TransportError, RemoteError) as exc:
                errors.append(f"{r.node_id}: {exc}")
        raise KVStoreUnavailable("no replica could be read: " + "; ".join(errors))

    async def batch_exists(self, keys: list[bytes]) -> list[bool]:
        resp = await self._call(self._stub.BatchExists,
                                pb.BatchExistsRequest(keys=self._ks(keys)))
        return list(resp.exists)

    async def prefix_lookup(self, keys: list[bytes]) -> int:
        """How many leading keys the store holds (complete objects)."""
        resp = await self._call(self._stub.PrefixLookup,
                                pb.PrefixLookupRequest(keys=self._ks(keys)))
        return min(resp.count, len(keys))

    async def stats(self) -> StoreStats:
        return convert.stats_from_pb(await self._call(self._stub.Stats, pb.StatsRequest()))
