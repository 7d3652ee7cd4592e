"""KVStoreClient.put_many against an in-process master (real Redis) and storage nodes, with a
store secret (every write carries the master's capability): one batch puts many objects,
per-object statuses, first writer wins, `ready` is honoured, and a node that stalls cannot
hold the batch past its deadline: its objects are revoked, their space freed, the
connection dropped; the connector's save path stores through it, verifiably."""

import asyncio
import contextlib
import dataclasses
import socket
import time

import numpy as np
import pytest
import torch

from pdserve.connector.codec import BlockCodec
from pdserve.connector.kvstore.client import KVStoreClient, StoreClientConfig
from pdserve.connector.kvstore.errors import KVStoreUnavailable
from pdserve.connector.kvstore.records import NodeInfo, PutStatus
from pdserve.connector.staging import staged_blocks
from pdserve.connector.store import put_stored
from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector
from pdserve.services.kvstore.config import MasterConfig, NodeConfig
from pdserve.services.kvstore.master_service import start_master
from pdserve.services.kvstore.node import start_node

MiB = 1 << 20
CFG = StoreClientConfig(transport="tcp", put_timeout_s=1.0, lookup_timeout_s=2.0,
                        connect_timeout_s=1.0, put_batch=16)


@contextlib.asynccontextmanager
async def store(redis_url, tmp_path, nodes=2):
    """(master address, RunningMaster): a secured master and `nodes` storage nodes."""
    secret = tmp_path / "store.secret"
    secret.write_text("cd" * 32)
    secret.chmod(0o600)
    master = await start_master(MasterConfig(port=0, redis_url=redis_url,
                                             namespace=f"t:{tmp_path.name}",
                                             store_secret_file=str(secret)))
    maddr = f"127.0.0.1:{master.port}"
    running = []
    try:
        for i in range(nodes):
            running.append(await start_node(NodeConfig(
                master_addr=maddr, capacity=32 * MiB, node_id=f"n{i}", transport="tcp",
                store_secret_file=str(secret))))
        yield maddr, master
    finally:
        for node in running:
            await node.stop()
        await master.stop(0)


def _run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


def _data(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8).tobytes()


def test_put_many_stores_each_object_with_its_own_status(redis_url, tmp_path):
    async def main():
        async with store(redis_url, tmp_path) as (maddr, _):
            async with KVStoreClient(maddr, config=CFG) as kv:
                assert await kv.put(b"old", b"x" * 100) is PutStatus.OK
                items = [(f"k{i}".encode(), _data(i, 1000 + 20_000 * i)) for i in range(40)]
                items += [(b"old", b"y" * 5), (b"k3", b"z" * 7)]  # stored / earlier in batch
                got = await kv.put_many(items, lease_s=5.0, replica_num=2)
                assert got == [PutStatus.OK] * 40 + [PutStatus.EXISTS] * 2
                for key, data in items[:40]:
                    assert await kv.get(key) == data
                assert await kv.get(b"old") == b"x" * 100  # first writer wins
                assert all(n.used > 40 * 1000 for n in (await kv.stats()).nodes)  # 2 replicas

    _run(main())


def test_put_many_sends_an_object_only_once_it_is_ready(redis_url, tmp_path):
    async def main():
        async with store(redis_url, tmp_path, nodes=1) as (maddr, _):
            async with KVStoreClient(maddr, config=CFG) as kv:
                bufs = [bytearray(200_000) for _ in range(3)]
                ready = [asyncio.get_running_loop().create_future() for _ in bufs]

                async def finish():
                    await asyncio.sleep(0.2)
                    for i, (buf, fut) in enumerate(zip(bufs, ready)):
                        buf[:] = _data(i, len(buf))  # the header / MAC written late
                        fut.set_result(None)

                filler = asyncio.ensure_future(finish())
                got = await kv.put_many([(b"r%d" % i, b) for i, b in enumerate(bufs)],
                                        ready=ready)
                await filler
                assert got == [PutStatus.OK] * 3
                for i, buf in enumerate(bufs):
                    assert await kv.get(b"r%d" % i) == _data(i, len(buf))

    _run(main())


def test_exists_for_a_complete_key_costs_no_poll(redis_url, tmp_path):
    """The master answers EXISTS only for a complete object (WRITING for one still being
    written), so a key stored before is EXISTS at once: one start call per put, none asked
    again, and the first writer's bytes stay."""
    async def main():
        async with store(redis_url, tmp_path, nodes=1) as (maddr, _):
            async with KVStoreClient(maddr, config=CFG) as kv:
                assert await kv.put(b"old", b"x" * 100) is PutStatus.OK
                calls = []

                def counted(name):
                    real = getattr(kv._stub, name)

                    def call(request, **kwargs):
                        calls.append(name)
                        return real(request, **kwargs)
                    setattr(kv._stub, name, call)

                for name in ("BatchPutStart", "PutStart", "BatchExists"):
                    counted(name)
                got = await kv.put_many([(b"old", b"y" * 5), (b"new", b"z" * 5)])
                assert got == [PutStatus.EXISTS, PutStatus.OK]
                assert await kv.put(b"old", b"y" * 5) is PutStatus.EXISTS
                assert calls == ["BatchPutStart", "PutStart"]
                assert await kv.get(b"old") == b"x" * 100

    _run(main())


@contextlib.asynccontextmanager
async def two_writers(redis_url, tmp_path, key, config):
    """(reader client, first writer's put_many, its gate, second writer's put_many): client a
    has started a put of `key` (PROCESSING at the master) whose bytes wait for `gate`; client
    b then put_many's the same key."""
    async with store(redis_url, tmp_path, nodes=1) as (maddr, _):
        async with KVStoreClient(maddr, config=config) as a, \
                KVStoreClient(maddr, config=config) as b:
            started, gate = asyncio.Event(), asyncio.get_running_loop().create_future()

            async def hold():
                started.set()
                await gate

            first = asyncio.ensure_future(a.put_many([(key, _data(1, 5000))], ready=[hold()]))
            await started.wait()
            yield b, first, gate, asyncio.ensure_future(b.put_many([(key, _data(2, 5000))]))


def test_exists_waits_for_the_other_writer_to_finish(redis_url, tmp_path):
    """A key another put is still writing is not readable: the master tells a second writer
    WRITING, and the client reports EXISTS (so its consumers may load the key) only once the
    first writer's object is complete."""
    slow = dataclasses.replace(CFG, put_timeout_s=10.0)

    async def main():
        async with two_writers(redis_url, tmp_path, b"dup", slow) as (b, first, gate, second):
            single = asyncio.ensure_future(b.put(b"dup", _data(3, 5000)))
            await asyncio.sleep(0.2)
            assert not second.done() and not single.done()  # not readable yet
            assert await b.get(b"dup") is None
            gate.set_result(None)
            assert await first == [PutStatus.OK]
            assert await second == [PutStatus.EXISTS]
            assert await single is PutStatus.EXISTS
            assert await b.get(b"dup") == _data(1, 5000)  # first writer wins

    _run(main())


def test_a_put_waits_for_another_writer_only_settle_timeout_s(redis_url, tmp_path):
    """A first writer still writing after settle_timeout_s: the second put gives up then
    (UNSETTLED), not at its own 10 s deadline, and the first writer's put is unaffected."""
    cfg = dataclasses.replace(CFG, put_timeout_s=10.0, settle_timeout_s=0.2)

    async def main():
        async with two_writers(redis_url, tmp_path, b"slow", cfg) as (b, first, gate, second):
            assert await asyncio.wait_for(second, 5.0) == [PutStatus.UNSETTLED]
            assert not first.done()
            gate.set_result(None)
            assert await first == [PutStatus.OK]
            assert await b.get(b"slow") == _data(1, 5000)

    _run(main())


def test_a_revoked_writers_key_is_taken_over_by_the_waiting_put(redis_url, tmp_path):
    """If the first writer is revoked, a put waiting on its key (WRITING) is granted the key
    and writes its own bytes at once, not after settle_timeout_s: one of the two waiting
    puts (put_many, put) stores it, the other then finds it complete (EXISTS), the revoked
    object's space is freed and one object's is held."""
    cfg = dataclasses.replace(CFG, put_timeout_s=10.0, settle_timeout_s=5.0)

    async def main():
        async with two_writers(redis_url, tmp_path, b"gone", cfg) as (b, first, gate, second):
            single = asyncio.ensure_future(b.put(b"gone", _data(2, 5000)))
            await asyncio.sleep(0.05)
            assert not second.done() and not single.done()
            held = sum(n.used for n in (await b.stats()).nodes)
            gate.set_exception(RuntimeError("header never written"))
            revoked_at = time.monotonic()
            got = await first
            assert isinstance(got[0], KVStoreUnavailable)  # revoked
            outcomes = [(await second)[0], await single]
            # without the takeover both would wait out settle_timeout_s, then be UNSETTLED
            assert time.monotonic() - revoked_at < cfg.settle_timeout_s / 2
            assert sorted(o.value for o in outcomes) == ["exists", "ok"]
            assert all(put_stored(o) for o in outcomes)
            assert await b.get(b"gone") == _data(2, 5000)  # the taker's bytes
            assert sum(n.used for n in (await b.stats()).nodes) == held

    _run(main())


@contextlib.asynccontextmanager
async def stalling_node(master, capacity=32 * MiB):
    """A node registered with the master that accepts connections and never reads."""
    loop = asyncio.get_running_loop()
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    accepted = []

    async def accept():
        while True:
            conn, _ = await loop.sock_accept(lsock)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            accepted.append(conn)

    task = loop.create_task(accept())
    await master.core.register_node(NodeInfo("stall", "127.0.0.1:%d" % lsock.getsockname()[1],
                                             capacity, "inc"))
    try:
        yield accepted
    finally:
        task.cancel()
        for conn in accepted:
            conn.close()
        lsock.close()


async def _closed_by_peer(loop, conn) -> bool:
    """True once the client's end is closed (EOF or reset), within 2 s."""
    conn.setblocking(False)
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        try:
            if not await asyncio.wait_for(loop.sock_recv(conn, 1 << 20), 0.5):
                return True
        except ConnectionResetError:
            return True
        except asyncio.TimeoutError:
            pass
    return False


def test_a_stalled_node_is_revoked_at_the_deadline_and_nothing_leaks(redis_url, tmp_path):
    async def main():
        async with store(redis_url, tmp_path, nodes=1) as (maddr, master):
            async with stalling_node(master) as accepted, KVStoreClient(maddr, config=CFG) as kv:
                items = [(b"s%d" % i, _data(i, 3 * MiB)) for i in range(6)]
                t0 = time.monotonic()
                got = await kv.put_many(items, lease_s=5.0)
                took = time.monotonic() - t0
                on_stall = [i for i, g in enumerate(got) if g is not PutStatus.OK]
                assert 0 < len(on_stall) < len(items) and took < CFG.put_timeout_s + 1.0
                assert all(isinstance(got[i], KVStoreUnavailable)
                           and "timed out" in str(got[i]) for i in on_stall)
                exists = await kv.batch_exists([k for k, _ in items])
                assert exists == [g is PutStatus.OK for g in got]
                usage = {n.node_id: n.used for n in (await kv.stats()).nodes}
                assert usage["stall"] == 0 and usage["n0"] > 0  # revoked: space freed
                assert accepted and await _closed_by_peer(asyncio.get_running_loop(),
                                                          accepted[0])
                assert not kv._revokes

    _run(main())


def test_a_cancelled_put_many_revokes_in_the_background(redis_url, tmp_path):
    async def main():
        async with store(redis_url, tmp_path, nodes=0) as (maddr, master):
            async with stalling_node(master):
                kv = KVStoreClient(maddr, config=CFG)
                task = asyncio.ensure_future(kv.put_many([(b"c0", _data(0, 2 * MiB))]))
                await asyncio.sleep(0.3)
                assert (await kv.stats()).nodes[0].used > 0  # started, being written
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await kv.close()  # waits for the revoke
                async with KVStoreClient(maddr, config=CFG) as check:
                    assert (await check.stats()).nodes[0].used == 0

    _run(main())


def test_an_unreachable_master_fails_each_item_without_raising():
    async def main():
        cfg = StoreClientConfig(transport="tcp", lookup_timeout_s=0.3)
        async with KVStoreClient("127.0.0.1:1", config=cfg) as kv:
            got = await kv.put_many([(b"a", b"1"), (b"b", b"2")])
        assert len(got) == 2 and all(isinstance(g, KVStoreUnavailable) for g in got)
        with pytest.raises(ValueError, match="empty"):
            await kv.put_many([(b"a", b"")])

    _run(main())


def test_the_connector_saves_a_step_through_put_many(redis_url, tmp_path):
    """StoreKVConnector over the real client: a step's blocks, two layer segments, each one
    put_many; every stored object decodes (MAC verified) to the block it came from."""
    codec = BlockCodec("0f" * 32, 4, 16, 3, 64)  # 4 layers: ~100 KB blocks
    keys = [bytes([i]) * 32 for i in range(12)]
    blocks = [torch.randn(codec.payload_shape) for _ in keys]

    async def client(maddr):
        return KVStoreClient(maddr, config=CFG)

    async def main():
        async with store(redis_url, tmp_path) as (maddr, _):
            await asyncio.to_thread(_save_and_check, maddr)

    def _save_and_check(maddr):
        conn = StoreKVConnector(None, codec, ConnectorConfig(role="producer",
                                                             layer_segments=2))
        try:
            kv = conn.io.run(client(maddr), timeout=10)
            conn.store = kv
            bufs = [bytearray(len(keys) * c.nbytes) for c in conn.segments.codecs]
            for j, block in enumerate(blocks):
                for s, c in enumerate(conn.segments.codecs):
                    b = conn.segments.bounds
                    c.write_payload(block[b[s]:b[s + 1]], memoryview(bufs[s])[j * c.nbytes:])
            with conn._lock:
                conn._save_started("r")
            conn.io.run(conn._put_blocks(staged_blocks(conn.segments, keys, bufs), ["r"]), 30)
            assert conn.get_finished()[0] == {"r"} and conn.stats.blocks_saved == len(keys)
            for key, block in zip(keys, blocks):
                for s, c in enumerate(conn.segments.codecs):
                    skey, b = conn.segments.key(key, s), conn.segments.bounds
                    data = bytearray(conn.io.run(kv.get(skey), 10))
                    assert torch.equal(c.decode(skey, memoryview(data)), block[b[s]:b[s + 1]])
            conn.io.run(kv.close(), 10)
        finally:
            conn.close()

    _run(main())


def test_an_object_whose_ready_fails_is_revoked_and_the_acked_ones_stay(redis_url, tmp_path):
    async def main():
        async with store(redis_url, tmp_path, nodes=1) as (maddr, _):
            async with KVStoreClient(maddr, config=CFG) as kv:
                loop = asyncio.get_running_loop()
                ready = [loop.create_future() for _ in range(4)]
                for fut in ready[:2]:
                    fut.set_result(None)

                async def fail_later():
                    await asyncio.sleep(0.3)  # after objects 0 and 1 are acked
                    ready[2].set_exception(ValueError("MAC failed"))
                failing = asyncio.ensure_future(fail_later())
                got = await kv.put_many([(b"f%d" % i, b"x" * 5000) for i in range(4)],
                                        ready=ready)
                await failing
                assert got[:2] == [PutStatus.OK] * 2
                assert all(isinstance(g, KVStoreUnavailable) and "not ready" in str(g)
                           for g in got[2:])
                assert await kv.batch_exists([b"f%d" % i for i in range(4)]) == [
                    True, True, False, False]
                assert (await kv.stats()).nodes[0].used == 2 * 5056  # 64-byte aligned

    _run(main())
