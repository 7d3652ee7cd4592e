"""The master's batched puts (BatchPutStart / BatchPutEnd / BatchPutRevoke): each entry
behaves as its single-object call (placement, first writer wins, leases, grants, revocation),
one refused entry leaves the others alone, and the edge bounds and checks every batch
before any state changes. Against a real Redis (tests/conftest.py's `redis_url`)."""

import asyncio
import math

import grpc
import pytest

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.connector.kvstore.auth import StoreKeys, check_capability
from pdserve.connector.kvstore.node_protocol import WRITE
from pdserve.connector.kvstore.records import PutStatus
from pdserve.services.kvstore.config import MasterConfig
from pdserve.services.kvstore.master_service import start_master
from pdserve.tests.integration.test_kvstore_master import MiB, Env, _nodes


@pytest.fixture
def env(redis_url):
    return Env(redis_url)


def test_batch_start_is_each_put_start_in_order(env):
    async def main():
        m = await env.make()
        await _nodes(m, 1, cap=3 * 1024)  # three 1000-byte objects (64-byte aligned)
        assert (await m.put_start(b"old", 1000, 0)).status is PutStatus.OK
        got = await m.put_start_many([(b"a", 1000, 5.0, 0), (b"old", 10, 0, 0),
                                      (b"a", 10, 0, 0), (b"b", 1000, 0, 0),
                                      (b"c", 1000, 0, 0), (b"d", 10, 0, 2)])
        assert [g.status for g in got] == [
            PutStatus.OK, PutStatus.WRITING, PutStatus.WRITING,  # first writer wins
            PutStatus.OK, PutStatus.NO_SPACE,  # room for old, a and b only (leased/unended)
            PutStatus.NOT_ENOUGH_NODES]
        assert got[0].replicas[0].offset != got[3].replicas[0].offset
        assert m.batch_exists([b"a", b"b"]) == [False, False]  # invisible until ended
        assert await m.put_end_many([b"a", b"zz", b"a"]) == [True, False, False]
        assert await m.put_revoke_many([b"b", b"a", b"b"]) == [True, False, False]
        assert m.batch_exists([b"a", b"b"]) == [True, False]
        assert m.stats().nodes[0].used == 2048  # old and a; b's space freed
        env.clock.t += 2.0
        assert await m.remove([b"a"]) == 0  # a's 5 s lease holds
        env.clock.t += 4.0
        assert await m.remove([b"a"]) == 1

    env.run(main)


def test_batch_start_evicts_and_persists_like_single_starts(env):
    async def main():
        m = await env.make(high_watermark=0.9, low_watermark=0.5)
        await _nodes(m, 1, cap=4 * MiB)
        for i in range(3):
            await m.put_start(f"v{i}".encode(), MiB, 0)
            await m.put_end(f"v{i}".encode())
        got = await m.put_start_many([(b"n0", MiB, 60.0, 0), (b"n1", MiB, 60.0, 0)])
        assert [g.status for g in got] == [PutStatus.OK, PutStatus.OK]
        assert m.stats().evictions >= 1
        again = await env.make()  # a restarted master reloads what the batch promised
        assert set(again._objects) == set(m._objects)
        assert await again.put_end_many([b"n0", b"n1"]) == [True, True]

    env.run(main)


def test_abandoned_batch_is_swept_at_its_put_deadline(env):
    async def main():
        m = await env.make(put_timeout_s=3.0)
        await _nodes(m, 1)
        await m.put_start_many([(b"x", 100, 0, 0), (b"y", 100, 0, 0)])
        env.clock.t += 3.5
        await m.sweep()
        assert m.stats().nodes[0].used == 0 and await m.put_end_many([b"x"]) == [False]

    env.run(main)


def test_batch_start_refuses_bad_entries_before_any_change(env):
    async def main():
        m = await env.make(max_lease_s=10.0)
        await _nodes(m, 1)
        for bad in [(b"b", 0, 0, 0), (b"b", 10, math.nan, 0), (b"b", 10, 11.0, 0)]:
            with pytest.raises(ValueError):
                await m.put_start_many([(b"a", 10, 0, 0), bad])
        assert m.stats().objects == 0 and m.stats().nodes[0].used == 0

    env.run(main)


def test_grpc_batch_puts_grant_each_entry_and_bound_the_batch(redis_url, tmp_path):
    secret = tmp_path / "store.secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    keys = StoreKeys.from_secret(("ab" * 32).encode())  # the file's content is the secret
    cfg = MasterConfig(port=0, redis_url=redis_url, namespace=f"t:{tmp_path.name}",
                       store_secret_file=str(secret), max_batch_puts=3, max_lease_s=60.0)

    async def main():
        running = await start_master(cfg)
        try:
            await _nodes(running.core, 2)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
                await _check_edge(pb_grpc.KVStoreMasterStub(ch), keys, running.core)
        finally:
            await running.stop(0)

    asyncio.run(asyncio.wait_for(main(), 30))


async def _check_edge(stub, keys, core) -> None:
    def entry(k, size=1000, lease=1.0):
        return pb.PutStartRequest(key=k, size=size, lease_s=lease)

    resp = await stub.BatchPutStart(pb.BatchPutStartRequest(
        entries=[entry(b"a" * 32), entry(b"b" * 32), entry(b"a" * 32)]))
    assert [r.status for r in resp.results] == [pb.PUT_START_OK, pb.PUT_START_OK,
                                               pb.PUT_START_WRITING]
    for r in resp.results[:2]:  # a write grant for exactly this range on this node
        rep = r.replicas[0]
        check_capability(keys.grant, WRITE, rep.node_id, rep.offset, 1000, rep.capability,
                         core._clock(), 0.0)
    for bad in ([entry(b"c")] * 4, [entry(b"c"), entry(b"d", lease=61.0)],
                [entry(b"c"), entry(b"x" * 65)], [entry(b"c", size=0)]):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.BatchPutStart(pb.BatchPutStartRequest(entries=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert core.stats().objects == 2  # the refused batches placed nothing
    for rpc in (stub.BatchPutEnd, stub.BatchPutRevoke):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rpc(pb.BatchPutEndRequest(keys=[b"a" * 32] * 4) if rpc is stub.BatchPutEnd
                      else pb.BatchPutRevokeRequest(keys=[b"a" * 32] * 4))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ended = await stub.BatchPutEnd(pb.BatchPutEndRequest(keys=[b"a" * 32, b"q" * 32]))
    assert list(ended.ok) == [True, False]
    revoked = await stub.BatchPutRevoke(pb.BatchPutRevokeRequest(keys=[b"b" * 32, b"a" * 32]))
    assert list(revoked.ok) == [True, False]  # a is complete: not revocable
    exists = await stub.BatchExists(pb.BatchExistsRequest(keys=[b"a" * 32, b"b" * 32]))
    assert list(exists.exists) == [True, False]
