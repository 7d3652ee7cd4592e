"""An attacker on the store's network, against a live master and storage node run with a
store secret: each attack is refused, and the store keeps serving the honest client.

The attacker can reach every port but holds no secret: it may replay or alter what it sees
(a capability for one range) and send hand-made frames and gRPC calls.
"""

import asyncio
import math
import socket
import time

import grpc
import pytest

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.connector.kvstore.auth import StoreKeys, read_secret
from pdserve.connector.kvstore.client import KVStoreClient
from pdserve.connector.kvstore.node_protocol import READ, WRITE, NodeOp
from pdserve.connector.kvstore.records import PutStatus
from pdserve.connector.transport import RemoteError, TransportError, framing, make_transport
from pdserve.tests.integration.kvstore_cluster import node_addresses, secured_cluster

BLOCK = bytes(range(256)) * 16  # 4 KiB


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with secured_cluster(tmp_path_factory.mktemp("kv")) as (maddr, secret, nodes, master):
        yield maddr, secret, nodes


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _stub(maddr):
    return pb_grpc.KVStoreMasterStub(grpc.insecure_channel(maddr))


async def _stored(kv, key: bytes):
    """Put BLOCK under key (if new) and return its replica list with read grants."""
    assert await kv.put(key, BLOCK, lease_s=60) in (PutStatus.OK, PutStatus.EXISTS)
    return await kv.replicas(key)


def test_honest_put_and_get_with_capabilities(cluster):
    maddr, _, _ = cluster

    async def main():
        async with KVStoreClient(maddr, "tcp") as kv:
            found = await _stored(kv, b"honest")
            assert all(len(r.capability) == 40 for r in found.replicas)  # grants are handed out
            assert await kv.get(b"honest") == BLOCK
    _run(main())


def test_read_outside_a_grant_is_refused_and_the_connection_stays_sane(cluster):
    maddr, _, _ = cluster

    async def main():
        async with KVStoreClient(maddr, "tcp") as kv:
            r = (await _stored(kv, b"victim")).replicas[0]
            conn = await make_transport("tcp").connect(r.address)
            try:
                for op in (NodeOp(READ, r.offset + 64, len(BLOCK), r.capability),  # moved
                           NodeOp(READ, r.offset, len(BLOCK) * 2, r.capability),  # widened
                           NodeOp(READ, 0, 8 << 20),  # no capability: the whole segment
                           NodeOp(READ, r.offset, len(BLOCK), bytes(40))):  # forged
                    with pytest.raises(RemoteError, match="refused"):
                        await conn.request(op.encode())
                out = memoryview(bytearray(len(BLOCK)))  # the same connection still serves
                msg = await conn.request(NodeOp(READ, r.offset, len(BLOCK),
                                                r.capability).encode(), out=out)
                assert bytes(msg.payload) == BLOCK
            finally:
                await conn.close()
    _run(main())


def test_write_with_a_read_grant_or_none_is_refused_before_landing(cluster):
    maddr, _, _ = cluster

    async def main():
        async with KVStoreClient(maddr, "tcp") as kv:
            r = (await _stored(kv, b"target")).replicas[0]
            t = make_transport("tcp")
            for cap in (r.capability, b""):  # a READ grant does not allow a WRITE
                conn = await t.connect(r.address)
                with pytest.raises((RemoteError, TransportError)):
                    await conn.request(NodeOp(WRITE, r.offset, len(BLOCK), cap).encode(),
                                       b"\xee" * len(BLOCK))
                await conn.close()
            assert await kv.get(b"target") == BLOCK  # not a byte changed
    _run(main())


def test_oversized_frame_to_a_node_is_refused(cluster):
    maddr, _, _ = cluster
    host, port = node_addresses(maddr)["n0"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(framing.pack(framing.KIND_REQUEST, NodeOp(WRITE, 0, 2**62).encode(), 2**62))
        prefix = s.recv(framing.PREFIX.size)
        assert framing.PREFIX.unpack(prefix)[0] == framing.KIND_ERROR
    test_honest_put_and_get_with_capabilities(cluster)  # the node is fine


def test_rogue_register_node_is_refused(cluster):
    maddr, _, _ = cluster
    stub = _stub(maddr)
    rogue = pb.RegisterNodeRequest(node_id="rogue", address="10.9.9.9:1", capacity=1 << 40,
                                   incarnation="x")
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterNode(rogue, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    rogue.capacity = 2**63  # bounded before anything else
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterNode(rogue, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    hijack = pb.RegisterNodeRequest(node_id="n0", address="10.9.9.9:1", capacity=1 << 20,
                                    incarnation="y", auth=bytes(40))  # a forged token
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterNode(hijack, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert list(node_addresses(maddr)) == ["n0"]
    test_honest_put_and_get_with_capabilities(cluster)  # n0 kept its objects and address


@pytest.mark.parametrize("lease", [math.inf, math.nan, -1.0, 1e9])
def test_infinite_or_nan_lease_is_refused(cluster, lease):
    maddr, _, _ = cluster
    with pytest.raises(grpc.RpcError) as err:
        _stub(maddr).PutStart(pb.PutStartRequest(key=b"k" * 32, size=100, lease_s=lease),
                              timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_remove_needs_the_store_secret(cluster):
    maddr, secret, _ = cluster

    async def main():
        async with KVStoreClient(maddr, "tcp") as kv:
            await _stored(kv, b"keep-me")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await kv.remove([b"keep-me"], force=True)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert await kv.get(b"keep-me") == BLOCK
        admin = StoreKeys.from_secret(read_secret(str(secret)))
        async with KVStoreClient(maddr, "tcp", store_keys=admin) as kv:
            assert await kv.remove([b"keep-me"], force=True) == 1
            assert await kv.get(b"keep-me") is None
    _run(main())


def test_a_stale_admin_token_is_refused(cluster):
    from pdserve.connector.kvstore.auth import remove_body, sign_token

    maddr, secret, _ = cluster
    admin = StoreKeys.from_secret(read_secret(str(secret)))
    old = sign_token(admin.admin, b"remove", remove_body([b"x"], True), time.time() - 3600)
    with pytest.raises(grpc.RpcError) as err:
        _stub(maddr).Remove(pb.RemoveRequest(keys=[b"x"], force=True, auth=old), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_store_keys_are_unpredictable_without_the_block_secret(cluster):
    """Engines store a block under a keyed hash of its block hash: an attacker who computes
    the block hash (model and prompt known) finds nothing there, so cannot probe it, and a
    block it writes under the raw hash is never read by the engines."""
    from pdserve.connector.kvstore.auth import BlockKeys

    maddr, _, _ = cluster
    engine_keys = BlockKeys.from_secret(b"the engines' block secret")

    async def main():
        async with KVStoreClient(maddr, "tcp", block_keys=engine_keys) as engine, \
                KVStoreClient(maddr, "tcp") as attacker:
            assert await attacker.put(b"H" * 32, b"forged" * 100, lease_s=60) is PutStatus.OK
            assert await engine.prefix_lookup([b"H" * 32]) == 0  # the squat is not seen
            assert await engine.put(b"H" * 32, BLOCK, lease_s=60) is PutStatus.OK
            assert await engine.get(b"H" * 32) == BLOCK
            assert await attacker.get(b"H" * 32) == b"forged" * 100
            assert await attacker.prefix_lookup([engine_keys.object_key(b"H" * 32)]) == 1
    _run(main())


def test_a_live_node_id_cannot_be_taken_over_even_with_the_secret(cluster):
    """Re-registering a live node's id from another address is refused: the node keeps its
    address and objects (a restart at the same address is a new incarnation, as before)."""
    from pdserve.connector.kvstore import convert
    from pdserve.connector.kvstore.auth import register_body, sign_token
    from pdserve.connector.kvstore.records import NodeInfo

    maddr, secret, _ = cluster
    keys = StoreKeys.from_secret(read_secret(str(secret)))
    node = NodeInfo("n0", "10.9.9.9:1", 1 << 20, "evil")
    req = convert.node_to_pb(node)
    req.auth = sign_token(keys.register, b"register", register_body(node), time.time())
    with pytest.raises(grpc.RpcError) as err:
        _stub(maddr).RegisterNode(req, timeout=5)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert node_addresses(maddr)["n0"] != "10.9.9.9:1"
    test_honest_put_and_get_with_capabilities(cluster)
