"""The KV store master as a gRPC service.

Lifecycle: `start_master` connects to Redis, loads the state (`MasterCore.start`), starts the
grpc.aio server and a sweep task (dead nodes, abandoned writes); `RunningMaster.stop` stops
the sweeps, then the server, then closes Redis. `run_master` runs it until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Optional

import grpc
import redis.asyncio as aioredis

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.services.common.grpc_standard import (StandardHealth, add_standard_services,
                                                    service_names)
from pdserve.services.kvstore import convert
from pdserve.services.kvstore.config import MasterConfig
from pdserve.services.kvstore.master import MasterCore
from pdserve.services.kvstore.metadata import RedisMetaStore

MAX_BATCH_KEYS = 8192  # per BatchGetReplicaList: a 131k-token prompt at 16-token blocks

log = logging.getLogger(__name__)


class MasterServicer(pb_grpc.KVStoreMasterServicer):
    def __init__(self, core: MasterCore, cfg: MasterConfig):
        self._core = core
        self._cfg = cfg

    async def PutStart(self, request, context):
        if request.size == 0 or request.lease_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "size must be > 0, lease >= 0")
        res = await self._core.put_start(request.key, request.size, request.lease_s,
                                         request.replica_num)
        return convert.put_start_to_pb(res)

    async def PutEnd(self, request, context):
        return pb.PutEndResponse(ok=await self._core.put_end(request.key))

    async def PutRevoke(self, request, context):
        return pb.PutRevokeResponse(ok=await self._core.put_revoke(request.key))

    async def GetReplicaList(self, request, context):
        return convert.replica_list_to_pb(await self._core.get_replicas(request.key))

    async def BatchGetReplicaList(self, request, context):
        if len(request.keys) > MAX_BATCH_KEYS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"at most {MAX_BATCH_KEYS} keys per lookup, got "
                                f"{len(request.keys)}")
        found = await self._core.get_replicas_many(list(request.keys))
        return pb.BatchGetReplicaListResponse(
            lists=[convert.replica_list_to_pb(rl) for rl in found])

    async def BatchExists(self, request, context):
        return pb.BatchExistsResponse(exists=self._core.batch_exists(list(request.keys)))

    async def PrefixLookup(self, request, context):
        return pb.PrefixLookupResponse(count=self._core.prefix_lookup(list(request.keys)))

    async def Remove(self, request, context):
        return pb.RemoveResponse(removed=await self._core.remove(list(request.keys),
                                                                 request.force))

    async def RegisterNode(self, request, context):
        try:
            node = convert.node_from_pb(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self._core.register_node(node)
        return pb.RegisterNodeResponse(heartbeat_interval_s=self._cfg.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        return pb.HeartbeatResponse(known=self._core.heartbeat(request.node_id,
                                                               request.incarnation))

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
            await core.sweep()
        except Exception:  # a Redis hiccup must not end the sweeps for good
            log.exception("kvstore sweep failed")


async def start_master(cfg: MasterConfig) -> RunningMaster:
    redis = aioredis.Redis.from_url(cfg.redis_url)
    core = MasterCore(cfg, RedisMetaStore(redis, cfg.namespace))
    await core.start()
    server = grpc.aio.server()
    pb_grpc.add_KVStoreMasterServicer_to_server(MasterServicer(core, cfg), server)
    health = add_standard_services(server, service_names((pb.DESCRIPTOR, "KVStoreMaster")),
                                   lambda: True)  # up while the process is; stop() ends it
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if port == 0:
        await redis.aclose()
        raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
    await server.start()
    sweeper = asyncio.get_running_loop().create_task(_sweep_forever(core, cfg.sweep_interval_s))
    log.info("kvstore master on %s:%d (redis %s)", cfg.host, port, cfg.redis_url)
    return RunningMaster(server, core, port, redis, sweeper, health)
