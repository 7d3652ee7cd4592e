"""The KV store master as a gRPC service.

Lifecycle: `start_master` connects to Redis, loads the state (`MasterCore.start`), starts the
grpc.aio server and a sweep task (dead nodes, abandoned writes); `RunningMaster.stop` stops
the sweeps, then the server, then closes Redis. `run_master` runs it until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import grpc
import redis.asyncio as aioredis

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.services.common.grpc_standard import (StandardHealth, add_standard_services,
                                                    service_names)
from pdserve.connector.kvstore import convert
from pdserve.connector.kvstore.auth import (AuthError, StoreKeys, check_token,
                                           load_store_keys, register_body, remove_body)
from pdserve.services.common.tls import add_port
from pdserve.services.common.tls_roles import MASTER_CALLERS, interceptors_for
from pdserve.services.kvstore import limits
from pdserve.services.kvstore.config import MasterConfig, redact_url
from pdserve.services.kvstore.master import MasterCore, NodeConflict
from pdserve.services.kvstore.metadata import RedisMetaStore

log = logging.getLogger(__name__)


def _ADMIN(keys: StoreKeys) -> bytes:
    return keys.admin


def _REGISTER(keys: StoreKeys) -> bytes:
    return keys.register


def _checked(method):
    """A servicer method whose ValueError (a limits check) is the caller's INVALID_ARGUMENT."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return wrapper


class MasterServicer(pb_grpc.KVStoreMasterServicer):
    def __init__(self, core: MasterCore, cfg: MasterConfig, keys: Optional[StoreKeys] = None,
                 clock: Callable[[], float] = time.time):
        self._core = core
        self._cfg = cfg
        self._keys = keys
        self._clock = clock

    async def _authorize(self, context, which: Callable[[StoreKeys], bytes], label: bytes,
                         body: bytes, token: bytes) -> None:
        """Abort with UNAUTHENTICATED unless `token` proves the caller holds the store secret."""
        if self._keys is None:
            return
        try:
            check_token(which(self._keys), label, body, token, self._clock(),
                        self._cfg.token_max_age_s)
        except AuthError as exc:
            log.warning("refused %s: %s (peer %s)", label.decode(), exc, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    def _checked_keys(self, keys) -> list[bytes]:
        return limits.check_keys(keys, self._cfg)

    @_checked
    async def PutStart(self, request, context):
        limits.check_put_start(request.key, request.size, request.lease_s, request.replica_num,
                               self._cfg)
        res = await self._core.put_start(request.key, request.size, request.lease_s,
                                         request.replica_num)
        return convert.put_start_to_pb(res)

    @_checked
    async def PutEnd(self, request, context):
        limits.check_key(request.key)
        return pb.PutEndResponse(ok=await self._core.put_end(request.key))

    @_checked
    async def PutRevoke(self, request, context):
        limits.check_key(request.key)
        return pb.PutRevokeResponse(ok=await self._core.put_revoke(request.key))

    @_checked
    async def BatchPutStart(self, request, context):
        limits.check_put_batch(request.entries, self._cfg)
        started = await self._core.put_start_many(
            [(e.key, e.size, e.lease_s, e.replica_num) for e in request.entries])
        return pb.BatchPutStartResponse(results=[convert.put_start_to_pb(p) for p in started])

    @_checked
    async def BatchPutEnd(self, request, context):
        keys = limits.check_put_keys(request.keys, self._cfg)
        return pb.BatchPutEndResponse(ok=await self._core.put_end_many(keys))

    @_checked
    async def BatchPutRevoke(self, request, context):
        keys = limits.check_put_keys(request.keys, self._cfg)
        return pb.BatchPutRevokeResponse(ok=await self._core.put_revoke_many(keys))

    @_checked
    async def GetReplicaList(self, request, context):
        limits.check_key(request.key)
        return convert.replica_list_to_pb(await self._core.get_replicas(request.key))

    @_checked
    async def BatchGetReplicaList(self, request, context):
        found = await self._core.get_replicas_many(self._checked_keys(request.keys))
        return pb.BatchGetReplicaListResponse(
            lists=[convert.replica_list_to_pb(rl) for rl in found])

    @_checked
    async def BatchExists(self, request, context):
        keys = self._checked_keys(request.keys)
        return pb.BatchExistsResponse(exists=self._core.batch_exists(keys))

    @_checked
    async def PrefixLookup(self, request, context):
        keys = self._checked_keys(request.keys)
        return pb.PrefixLookupResponse(count=self._core.prefix_lookup(keys))

    @_checked
    async def Remove(self, request, context):
        keys = self._checked_keys(request.keys)
        await self._authorize(context, _ADMIN, b"remove", remove_body(keys, request.force),
                              request.auth)
        return pb.RemoveResponse(removed=await self._core.remove(keys, request.force))

    @_checked
    async def RegisterNode(self, request, context):
        limits.check_node(request.node_id, request.address, request.capacity,
                          request.incarnation, self._cfg)
        node = convert.node_from_pb(request)
        await self._authorize(context, _REGISTER, b"register", register_body(node),
                              request.auth)
        try:
            await self._core.register_node(node)
        except NodeConflict as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        return pb.RegisterNodeResponse(heartbeat_interval_s=self._cfg.heartbeat_interval_s)

    @_checked
    async def Heartbeat(self, request, context):
        return pb.HeartbeatResponse(known=self._core.heartbeat(request.node_id,
                                                               request.incarnation))

    @_checked
    async def Stats(self, request, context):
        return convert.stats_to_pb(self._core.stats())


@dataclass
class RunningMaster:
    server: grpc.aio.Server
    core: MasterCore
    port: int
    redis: aioredis.Redis
    sweeper: asyncio.Task
    health: Optional[StandardHealth] = None  # grpc.health.v1

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.health is not None:
            self.health.stop_serving()
        self.sweeper.cancel()
        await asyncio.gather(self.sweeper, return_exceptions=True)
        await self.server.stop(grace_s)
        await self.redis.aclose()


async def _sweep_forever(core: MasterCore, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await core.flush_renewals()
            await core.sweep()
        except Exception as exc:  # a Redis hiccup must not end the sweeps for good
            log.warning("kvstore sweep failed (%s: %s); retrying", type(exc).__name__, exc)


async def start_master(cfg: MasterConfig) -> RunningMaster:
    keys = load_store_keys(cfg.store_secret_file)
    redis = aioredis.Redis.from_url(cfg.resolved_redis_url())
    core = MasterCore(cfg, RedisMetaStore(redis, cfg.namespace), keys=keys)
    await core.start()
    server = grpc.aio.server(maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
                             interceptors=interceptors_for(cfg.tls.enabled, MASTER_CALLERS))
    pb_grpc.add_KVStoreMasterServicer_to_server(MasterServicer(core, cfg, keys), server)
    health = add_standard_services(server, service_names((pb.DESCRIPTOR, "KVStoreMaster")),
                                   lambda: True)  # up while the process is; stop() ends it
    port = add_port(server, f"{cfg.host}:{cfg.port}", cfg.tls)
    if port == 0:
        await redis.aclose()
        raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
    await server.start()
    sweeper = asyncio.get_running_loop().create_task(_sweep_forever(core, cfg.sweep_interval_s))
    log.info("kvstore master on %s:%d, %s (redis %s)", cfg.host, port,
             "mutual TLS" if cfg.tls.enabled else "plaintext",
             redact_url(cfg.resolved_redis_url()))
    return RunningMaster(server, core, port, redis, sweeper, health)
