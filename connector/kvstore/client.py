"""The KV store client: metadata calls to the master over gRPC, bytes to and from storage
nodes over the KV transport.

A put is PutStart (the master places each replica: node + offset) -> write the bytes to every
replica in parallel -> PutEnd; if a write fails, PutRevoke, so readers never see a half-written
object. A get asks for the replica list (which renews the object's lease) and reads from the
first replica that answers. A miss is a return value (None / PutStatus); only an unreachable
master or storage node raises, as `KVStoreUnavailable`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import grpc

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.connector.transport import RemoteError, Transport, TransportError, make_transport
from pdserve.connector.transport.base import Buffer, as_bytes_view
from pdserve.connector.kvstore import convert
from pdserve.connector.kvstore.auth import StoreKeys, remove_body, sign_token
from pdserve.connector.kvstore.conn_pool import ConnectionPool
from pdserve.connector.kvstore.errors import KVStoreUnavailable
from pdserve.connector.kvstore.node_protocol import READ, WRITE, NodeOp
from pdserve.connector.kvstore.records import PutStatus, Replica, ReplicaList, StoreStats

log = logging.getLogger(__name__)
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


class KVStoreClient:
    def __init__(self, master_addr: str, transport: Transport | str = "auto", *,
                 rpc_timeout_s: float = 5.0, conns_per_node: int = 4,
                 store_keys: Optional[StoreKeys] = None):
        self._store_keys = store_keys  # only admin calls (remove) need them
        self._transport = make_transport(transport) if isinstance(transport, str) else transport
        self._channel = grpc.aio.insecure_channel(master_addr)
        self._stub = pb_grpc.KVStoreMasterStub(self._channel)
        self._timeout = rpc_timeout_s
        self._pool = ConnectionPool(self._transport, conns_per_node)
        self.master_addr = master_addr

    async def close(self) -> None:
        await self._pool.close()
        await self._channel.close()

    async def __aenter__(self) -> "KVStoreClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, method: str, request):
        try:
            return await getattr(self._stub, method)(request, timeout=self._timeout)
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
        view = as_bytes_view(data)
        if not len(view):
            raise ValueError("cannot store an empty object")
        started = convert.put_start_from_pb(await self._call("PutStart", pb.PutStartRequest(
            key=key, size=len(view), lease_s=lease_s, replica_num=replica_num)))
        if started.status is not PutStatus.OK:
            return started.status
        try:
            await asyncio.gather(*(self._write(r, view) for r in started.replicas))
        except BaseException:
            await self._revoke_quietly(key)
            raise
        ended = await self._call("PutEnd", pb.PutEndRequest(key=key))
        return PutStatus.OK if ended.ok else PutStatus.REVOKED

    async def _write(self, replica: Replica, view: memoryview) -> None:
        header = NodeOp(WRITE, replica.offset, len(view), replica.capability).encode()
        try:
            async with self._pool.connection(replica.address) as conn:
                await conn.request(header, view)
        except (TransportError, RemoteError) as exc:
            raise KVStoreUnavailable(f"write to node {replica.node_id} failed: {exc}") from exc

    async def _revoke_quietly(self, key: bytes) -> None:
        try:  # best effort: if the master is gone too, its put timeout reclaims the space
            await self._call("PutRevoke", pb.PutRevokeRequest(key=key))
        except KVStoreUnavailable as exc:
            log.warning("PutRevoke failed (%s); the master's put timeout will reclaim it", exc)

    async def remove(self, keys: list[bytes], force: bool = False) -> int:
        """An admin call: needs the store keys when the master has a store secret."""
        req = pb.RemoveRequest(keys=keys, force=force)
        if self._store_keys is not None:
            req.auth = sign_token(self._store_keys.admin, b"remove", remove_body(keys, force),
                                  time.time())
        return (await self._call("Remove", req)).removed

    # ---- reads -------------------------------------------------------------------------

    async def replicas(self, key: bytes) -> ReplicaList | None:
        return convert.replica_list_from_pb(
            await self._call("GetReplicaList", pb.GetReplicaListRequest(key=key)))

    async def replicas_many(self, keys: list[bytes]) -> list[ReplicaList | None]:
        resp = await self._call("BatchGetReplicaList", pb.BatchGetReplicaListRequest(keys=keys))
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
        errors = []
        for r in found.replicas:
            try:
                async with self._pool.connection(r.address) as conn:
                    msg = await conn.request(
                        NodeOp(READ, r.offset, found.size, r.capability).encode(), out=out)
                if len(msg.payload) == len(out):  # then it landed in `out`
                    return
                errors.append(f"{r.node_id}: answered {len(msg.payload)} bytes")
            except (TransportError, RemoteError) as exc:
                errors.append(f"{r.node_id}: {exc}")
        raise KVStoreUnavailable("no replica could be read: " + "; ".join(errors))

    async def batch_exists(self, keys: list[bytes]) -> list[bool]:
        resp = await self._call("BatchExists", pb.BatchExistsRequest(keys=keys))
        return list(resp.exists)

    async def prefix_lookup(self, keys: list[bytes]) -> int:
        resp = await self._call("PrefixLookup", pb.PrefixLookupRequest(keys=keys))
        return resp.count

    async def stats(self) -> StoreStats:
        return convert.stats_from_pb(await self._call("Stats", pb.StatsRequest()))
