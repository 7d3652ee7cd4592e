"""The KV store across real processes: a master, two storage nodes, a client here.

redis-server, the master and the nodes are started on free loopback ports and stopped even
when a test fails.
"""

import asyncio
import contextlib
import os
import signal
import sys
import threading

import grpc
import numpy as np
import pytest

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.connector.transport import ucx_available
from pdserve.connector.kvstore.client import KVStoreClient, StoreClientConfig
from pdserve.connector.kvstore.errors import KVStoreUnavailable
from pdserve.connector.kvstore.records import PutStatus
from pdserve.services.kvstore.redis_proc import RedisProcess
from pdserve.services.launcher import Child, free_port, wait_until

KV = [sys.executable, "-m", "pdserve.services.kvstore.cli"]


def _node_count(master_addr: str) -> int:
    with grpc.insecure_channel(master_addr) as ch:
        try:
            return len(pb_grpc.KVStoreMasterStub(ch).Stats(pb.StatsRequest(), timeout=1).nodes)
        except grpc.RpcError:
            return -1


@contextlib.contextmanager
def kv_cluster(tmp_path, transport: str, nodes: int = 2):
    """(master address, node children); everything stops on exit, failure included."""
    children = []
    with RedisProcess() as redis:
        try:
            maddr = f"127.0.0.1:{free_port('127.0.0.1')}"
            master = Child("master", KV + ["kvstore-master", "--port", maddr.split(":")[1],
                                           "--redis-url", redis.url], tmp_path)
            master.start()
            children.append(master)
            wait_until(lambda: _node_count(maddr) >= 0, master, 60, threading.Event())
            for i in range(nodes):
                node = Child(f"node{i}", KV + ["kvstore-node", "--master", maddr,
                                               "--node-id", f"n{i}", "--capacity-mib", "32",
                                               "--transport", transport], tmp_path)
                node.start()
                children.append(node)
                wait_until(lambda: _node_count(maddr) > i, node, 60, threading.Event())
            yield maddr, children[1:], master
        finally:
            for child in reversed(children):
                child.stop(5.0)


def _kill(child: Child) -> None:
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait(5)


TRANSPORTS = ["tcp"] + (["ucx"] if ucx_available()[0] else [])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_put_get_replicas_and_failures(tmp_path, transport):
    data = np.random.default_rng(3).integers(0, 255, 3 << 20, dtype=np.uint8)

    async def main(maddr, nodes, master):
        async with KVStoreClient(maddr, transport) as kv:
            assert await kv.put(b"blk0", data, lease_s=0, replica_num=2) is PutStatus.OK
            # on both nodes: blk1 must outlive node 0, whose objects the master may drop while
            # a slow transport (UCX) is still finding out that the node is dead
            assert await kv.put(b"blk1", b"small", lease_s=0, replica_num=2) is PutStatus.OK
            assert await kv.put(b"blk0", b"again") is PutStatus.EXISTS
            assert await kv.get(b"blk0") == data.tobytes()
            out = np.zeros(4 << 20, dtype=np.uint8)
            assert await kv.get_into(b"blk1", out) == 5 and bytes(out[:5]) == b"small"
            assert await kv.get(b"nope") is None
            outs = [np.zeros(4 << 20, dtype=np.uint8) for _ in range(3)]
            sizes = await kv.get_many_into([b"blk1", b"nope", b"blk0"], outs)
            assert sizes == [5, None, data.size]
            assert bytes(outs[0][:5]) == b"small" and np.array_equal(outs[2][:data.size], data)
            with pytest.raises(ValueError, match="8192"):  # INVALID_ARGUMENT
                await kv.replicas_many([b"k"] * 8193)
            assert await kv.batch_exists([b"blk1", b"nope", b"blk0"]) == [True, False, True]
            assert await kv.prefix_lookup([b"blk0", b"blk1", b"nope", b"blk0"]) == 2
            assert sorted(n.node_id for n in (await kv.stats()).nodes) == ["n0", "n1"]

            _kill(nodes[0])  # one replica left: reads still work
            assert await kv.get(b"blk0") == data.tobytes()
            with pytest.raises(KVStoreUnavailable):  # 2 replicas on 2 nodes: one is dead
                await kv.put(b"blk2", b"x" * 4096, replica_num=2)
            assert await kv.batch_exists([b"blk2"]) == [False]
            assert await kv.remove([b"blk1", b"nope"]) == 0  # just read: its lease holds
            assert await kv.remove([b"blk1", b"nope"], force=True) == 1
            _kill(nodes[1])
            with pytest.raises(KVStoreUnavailable):
                await kv.get(b"blk0")
            master.stop(5.0)
            with pytest.raises(KVStoreUnavailable):
                await kv.batch_exists([b"blk0"])

    with kv_cluster(tmp_path, transport) as (maddr, nodes, master):
        asyncio.run(asyncio.wait_for(main(maddr, nodes, master), 120))


def test_failed_write_is_revoked_and_dead_node_dropped(tmp_path):
    async def main(maddr, nodes):
        cfg = StoreClientConfig(lookup_timeout_s=3)
        async with KVStoreClient(maddr, "tcp", config=cfg) as kv:
            _kill(nodes[0])
            with pytest.raises(KVStoreUnavailable):
                await kv.put(b"k", b"y" * 1000, replica_num=2)
            assert await kv.batch_exists([b"k"]) == [False]  # revoked, never visible
            for _ in range(100):  # the master drops n0 after its node timeout (5 s)
                if [n.node_id for n in (await kv.stats()).nodes] == ["n1"]:
                    break
                await asyncio.sleep(0.2)
            assert [n.node_id for n in (await kv.stats()).nodes] == ["n1"]
            assert await kv.put(b"k", b"y" * 1000) is PutStatus.OK
            assert await kv.get(b"k") == b"y" * 1000

    with kv_cluster(tmp_path, "tcp") as (maddr, nodes, _):
        asyncio.run(asyncio.wait_for(main(maddr, nodes), 120))
