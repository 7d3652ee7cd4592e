"""A KV store storage node: a memory segment served over the transport, known to the master.

Lifecycle: `start_node` allocates the segment, listens on the transport, registers with the
master (id, transport address, capacity, a fresh incarnation id) and starts heartbeating.
A heartbeat the master does not recognise (it dropped us, or lost us) means: register again
(the master then treats the segment as empty). `RunningNode.stop` stops the heartbeats and the
listener. A node that cannot reach the master keeps serving and keeps retrying.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

import grpc

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.connector.transport import Listener, make_transport
from pdserve.services.kvstore.config import NodeConfig
from pdserve.services.kvstore.segment import Segment, SegmentHandler

log = logging.getLogger(__name__)


@dataclass
class RunningNode:
    node_id: str
    address: str
    listener: Listener
    channel: grpc.aio.Channel
    heartbeats: asyncio.Task
    segment: Segment

    async def stop(self) -> None:
        self.heartbeats.cancel()
        await asyncio.gather(self.heartbeats, return_exceptions=True)
        await self.listener.close()
        await self.channel.close()


async def _register(stub, req: pb.RegisterNodeRequest) -> float:
    resp = await stub.RegisterNode(req, timeout=5.0)
    return resp.heartbeat_interval_s or 1.0


async def _heartbeat_forever(stub, reg: pb.RegisterNodeRequest, interval_s: float) -> None:
    beat = pb.HeartbeatRequest(node_id=reg.node_id, incarnation=reg.incarnation)
    while True:
        await asyncio.sleep(interval_s)
        try:
            resp = await stub.Heartbeat(beat, timeout=max(interval_s, 1.0))
            if not resp.known:
                log.warning("master does not know node %s; registering again", reg.node_id)
                interval_s = await _register(stub, reg)
        except grpc.aio.AioRpcError as exc:
            log.warning("heartbeat to the master failed: %s", exc.code().name)


async def start_node(cfg: NodeConfig) -> RunningNode:
    segment = Segment(cfg.capacity)
    listener = await make_transport(cfg.transport).listen(cfg.host, cfg.port,
                                                          SegmentHandler(segment))
    node_id = cfg.node_id or listener.address
    channel = grpc.aio.insecure_channel(cfg.master_addr)
    stub = pb_grpc.KVStoreMasterStub(channel)
    reg = pb.RegisterNodeRequest(node_id=node_id, address=listener.address,
                                 capacity=cfg.capacity, incarnation=uuid.uuid4().hex)
    try:
        interval_s = await _register(stub, reg)
    except BaseException:
        await listener.close()
        await channel.close()
        raise
    heartbeats = asyncio.get_running_loop().create_task(
        _heartbeat_forever(stub, reg, interval_s))
    log.info("kvstore node %s serving %d bytes at %s", node_id, cfg.capacity, listener.address)
    return RunningNode(node_id, listener.address, listener, channel, heartbeats, segment)
