"""A KV store storage node: a memory segment served over the transport, known to the master.

Lifecycle: `start_node` allocates the segment, listens on the transport, registers with the
master (id, transport address, capacity, a fresh incarnation id, and a token from the store
secret when there is one) and starts heartbeating. With a store secret the node serves only
requests whose capability the master signed for it (segment.py).
A heartbeat the master does not recognise (it dropped us, or lost us) means: register again
(the master then treats the segment as empty). `RunningNode.stop` stops the heartbeats and the
listener. A node that cannot reach the master keeps serving and keeps retrying.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import grpc

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.connector.kvstore import convert
from pdserve.connector.kvstore.auth import (StoreKeys, load_store_keys, register_body,
                                           sign_token)
from pdserve.connector.kvstore.records import NodeInfo
from pdserve.connector.transport import Listener, make_transport
from pdserve.connector.transport.tcp import TcpTransport
from pdserve.services.common.tls import open_channel
from pdserve.services.kvstore.config import NodeConfig
from pdserve.services.kvstore.segment import GrantCheck, Segment, SegmentHandler

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


async def _register(stub, node: NodeInfo, keys: Optional[StoreKeys]) -> float:
    """Register (again); the token is signed afresh each time (tokens are short-lived)."""
    req = convert.node_to_pb(node)
    if keys is not None:
        req.auth = sign_token(keys.register, b"register", register_body(node), time.time())
    resp = await stub.RegisterNode(req, timeout=5.0)
    return resp.heartbeat_interval_s or 1.0


async def _heartbeat_forever(stub, reg: NodeInfo, keys: Optional[StoreKeys],
                             interval_s: float) -> None:
    beat = pb.HeartbeatRequest(node_id=reg.node_id, incarnation=reg.incarnation)
    while True:
        await asyncio.sleep(interval_s)
        try:
            resp = await stub.Heartbeat(beat, timeout=max(interval_s, 1.0))
            if not resp.known:
                log.warning("master does not know node %s; registering again", reg.node_id)
                interval_s = await _register(stub, reg, keys)
        except grpc.aio.AioRpcError as exc:
            log.warning("heartbeat to the master failed: %s", exc.code().name)


async def _listen(cfg: NodeConfig, handler: SegmentHandler) -> Listener:
    """Over TCP, a thread per connection with blocking calls: the segment's requests never
    await, and a blocking receive costs a syscall where the event loop costs a round of
    epoll and task wake-ups per wait (connector/transport/tcp_threads.py)."""
    transport = make_transport(cfg.transport)
    if isinstance(transport, TcpTransport):
        return await transport.listen_threads(cfg.host, cfg.port, handler,
                                              max_connections=cfg.max_connections,
                                              frame_timeout_s=cfg.frame_timeout_s)
    return await transport.listen(cfg.host, cfg.port, handler)


async def start_node(cfg: NodeConfig) -> RunningNode:
    keys = load_store_keys(cfg.store_secret_file)
    segment = Segment(cfg.capacity)
    handler = SegmentHandler(segment)
    listener = await _listen(cfg, handler)
    node_id = cfg.node_id or listener.address
    if keys is not None:  # before registering: the master grants nothing on us before that
        handler.grants = GrantCheck(keys.grant, node_id, cfg.grant_skew_s)
    channel = open_channel(cfg.master_addr, cfg.tls, "kvstore-master")
    stub = pb_grpc.KVStoreMasterStub(channel)
    reg = NodeInfo(node_id, listener.address, cfg.capacity, uuid.uuid4().hex)
    try:
        interval_s = await _register(stub, reg, keys)
    except BaseException:
        await listener.close()
        await channel.close()
        raise
    heartbeats = asyncio.get_running_loop().create_task(
        _heartbeat_forever(stub, reg, keys, interval_s))
    log.info("kvstore node %s serving %d bytes at %s", node_id, cfg.capacity, listener.address)
    return RunningNode(node_id, listener.address, listener, channel, heartbeats, segment)
