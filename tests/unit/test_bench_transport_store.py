"""The transport bench's store-path contenders do what the connector's put does: every
object's header is the codec's MAC (a reader verifies it), every WRITE carries a capability
the node checks, and a refused write fails the run rather than counting as throughput."""

import asyncio

import numpy as np
import pytest

from pdserve.bench import transport_store as store
from pdserve.connector.codec import BlockCodec, BlockCodecError
from pdserve.connector.transport import TransportError
from pdserve.connector.transport.tcp import TcpTransport
from pdserve.services.kvstore.segment import GrantCheck, Segment, SegmentHandler


async def _node(grant_key: bytes):
    segment = Segment(1 << 20)
    listener = await TcpTransport().listen_threads(
        "127.0.0.1", 0, SegmentHandler(segment, GrantCheck(grant_key, "bench")))
    return segment, listener


@pytest.mark.parametrize("mode", ["batched", "single"])
def test_store_path_writes_verifiable_blocks_under_capabilities(mode):
    async def main():
        segment, listener = await _node(store.GRANT_KEY)
        conn = await TcpTransport().connect(listener.address)
        reader = BlockCodec("0f" * 32, 1, 1, 1, 1, mac_key=store.MAC_KEY)  # the bench's
        ring = [memoryview(np.random.default_rng(i).integers(0, 255, reader.nbytes,
                                                             dtype=np.uint8)) for i in range(3)]
        send = (store.batched_sender(conn, "mac", 2) if mode == "batched"
                else store.single_sender(conn, "mac"))
        try:
            await send(ring, 5)
        finally:
            send.close()
            await conn.close()
            await listener.close()
        landed = bytearray(segment.view[:reader.nbytes])  # the last write: ring[4 % 3]
        assert landed == bytes(ring[1])
        reader.decode(b"k" * 32, memoryview(landed))  # its header: the codec's MAC, valid
        landed[-1] ^= 1
        with pytest.raises(BlockCodecError, match="MAC"):
            reader.decode(b"k" * 32, memoryview(landed))

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_refused_write_fails_the_batched_run():
    async def main():
        _, listener = await _node(b"another-grant-key-0123456789abcd")
        conn = await TcpTransport().connect(listener.address)
        send = store.batched_sender(conn, "mac", 4)
        ring = [memoryview(bytearray(4096))]
        try:
            with pytest.raises((RuntimeError, TransportError)):  # refused, then dropped
                await send(ring, 4)
        finally:
            send.close()
            await conn.close()
            await listener.close()

    asyncio.run(asyncio.wait_for(main(), 30))
