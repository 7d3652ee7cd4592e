"""The connector's save path batches: one put_many per layer segment of a step, each header
(MAC) sealed on the loop just before its object is sent,
and a store's per-item failures counted per block."""

import asyncio

import torch

from pdserve.connector.codec import HEADER_SIZE, BlockCodec
from pdserve.connector.save_io import InlineSeals
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


def test_inline_seals_seal_each_header_once_when_first_asked_for_slices_included():
    n = 6
    bufs = [bytearray(CODEC.nbytes) for _ in range(n)]
    objs = [(bytes([i]) * 32, memoryview(b)) for i, b in enumerate(bufs)]

    async def main():
        seals = InlineSeals(CODEC, objs)
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
