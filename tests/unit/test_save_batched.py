"""The connector's save path batches: one put_many per layer segment of a step, each header
(MAC) sealed once before its object is sent (by the I/O worker or the loop),
and a store's per-item failures counted per block."""

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass

import pytest
import torch

from pdserve.connector.codec import HEADER_SIZE, BlockCodec
from pdserve.connector.save_io import SharedSeals
from pdserve.connector.staging import staged_blocks
from pdserve.connector.store import InMemoryBlockStore
from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector

CODEC = BlockCodec("0f" * 32, 4, 4, 2, 8)


class _Counting(InMemoryBlockStore):
    def __init__(self):
        super().__init__()
        self.batches = []

    async def put_many(self, items, lease_s=0.0, ready=None):
        self.batches.append(len(items))
        return await super().put_many(items, lease_s, ready)


def _staged(conn, keys, blocks):
    bufs = [bytearray(len(keys) * c.nbytes) for c in conn.segments.codecs]
    b = conn.segments.bounds
    for j, block in enumerate(blocks):
        for s, c in enumerate(conn.segments.codecs):
            c.write_payload(block[b[s]:b[s + 1]], memoryview(bufs[s])[j * c.nbytes:])
    return staged_blocks(conn.segments, keys, bufs)


def test_a_step_is_one_put_many_per_segment_and_every_object_verifies():
    store = _Counting()
    conn = StoreKVConnector(store, CODEC, ConnectorConfig(role="producer", layer_segments=2))
    keys = [bytes([i]) * 32 for i in range(9)]
    blocks = [torch.randn(CODEC.payload_shape) for _ in keys]
    try:
        with conn._lock:
            conn._save_started("r")
        conn.io.run(conn._put_blocks(_staged(conn, keys, blocks), ["r"]), timeout=30)
        assert store.batches == [len(keys), len(keys)] and conn.get_finished()[0] == {"r"}
        b = conn.segments.bounds
        for key, block in zip(keys, blocks):
            for s, c in enumerate(conn.segments.codecs):
                skey = conn.segments.key(key, s)
                got = c.decode(skey, memoryview(bytearray(store.objects[skey])))
                assert torch.equal(got, block[b[s]:b[s + 1]])
    finally:
        conn.close()


def test_per_item_failures_fail_only_their_blocks():
    store = InMemoryBlockStore()
    put = store.put

    async def flaky(key, data, lease_s=0.0):
        if key[0] % 3 == 0:
            raise ConnectionError("node down")
        return await put(key, data, lease_s)
    store.put = flaky
    conn = StoreKVConnector(store, CODEC, ConnectorConfig(role="producer"))
    keys = [bytes([i]) * 32 for i in range(7)]
    try:
        with conn._lock:
            conn._save_started("r")
        blocks = [torch.randn(CODEC.payload_shape) for _ in keys]
        conn.io.run(conn._put_blocks(_staged(conn, keys, blocks), ["r"]), timeout=30)
        failed = sum(1 for k in keys if k[0] % 3 == 0)
        assert conn.stats.blocks_saved == len(keys) - failed
        assert conn.stats.failure_reasons == {"save:ConnectionError": failed}
        assert set(store.objects) == {k for k in keys if k[0] % 3}
    finally:
        conn.close()


def test_without_a_worker_each_header_is_sealed_once_when_first_asked_for_slices_included():
    n = 6
    bufs = [bytearray(CODEC.nbytes) for _ in range(n)]
    objs = [(bytes([i]) * 32, memoryview(b)) for i, b in enumerate(bufs)]

    async def main():
        seals = SharedSeals(CODEC, objs, None)
        assert len(seals) == n and all(v[:HEADER_SIZE] == bytes(HEADER_SIZE) for _, v in objs)
        await seals[2]
        sealed = [v[:HEADER_SIZE] != bytes(HEADER_SIZE) for _, v in objs]
        assert sealed == [False, False, True, False, False, False]  # nothing ahead of need
        first = bytes(objs[2][1][:HEADER_SIZE])
        await seals[2]  # a second replica's write: no new nonce, the same header
        assert bytes(objs[2][1][:HEADER_SIZE]) == first
        tail = seals[3:]  # put_many's batches: a slice shares the state of the whole
        assert len(tail) == 3
        await tail[0]
        await tail[2]
        await seals[3]
        sealed = [v[:HEADER_SIZE] != bytes(HEADER_SIZE) for _, v in objs]
        assert sealed == [False, False, True, True, False, True]
        for i in (0, 1, 4):
            await seals[i]

    asyncio.run(main())
    for key, view in objs:
        CODEC.decode(key, view)  # every MAC verifies


def test_shared_seals_seal_each_object_once_by_the_worker_or_the_loop():
    n = 7
    bufs = [bytearray(CODEC.nbytes) for _ in range(n)]
    objs = [(bytes([i]) * 32, memoryview(b)) for i, b in enumerate(bufs)]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    gate = threading.Event()  # holds the worker back, so the loop seals what it asks for
    sealers: dict[int, str] = {}
    seals_made: list[int] = []

    @dataclass(frozen=True)
    class Recording(BlockCodec):
        def header(self, key, payload):
            sealers.setdefault(key[0], threading.current_thread().name)
            seals_made.append(key[0])
            if threading.current_thread() is not threading.main_thread():
                gate.wait(10)
            return super().header(key, payload)
    codec = Recording(CODEC.fingerprint, CODEC.num_layers, CODEC.block_size,
                      CODEC.num_kv_heads, CODEC.head_dim)

    async def main():
        loop = asyncio.get_running_loop()
        starts = []

        def start(fn):
            starts.append(fn)
            return loop.run_in_executor(pool, fn)
        seals = SharedSeals(codec, objs, start)
        tail = seals[4:]  # put_many's batches: a slice shares the state of the whole
        await tail[1]  # object 5, by the loop: the worker is held at object 0
        assert sealers.get(5) == threading.main_thread().name and len(starts) == 1
        gate.set()
        await seals[0]  # the worker's: waited for, not sealed twice
        for i in range(n):
            await seals[i]
        await seals.drain()
        assert len(starts) == 1  # one worker call for the whole put
        assert sorted(seals_made) == list(range(n))  # each object sealed exactly once
        assert sealers[0] != threading.main_thread().name

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()
    for key, view in objs:
        codec.decode(key, view)  # every MAC verifies, each sealed once (one nonce)
