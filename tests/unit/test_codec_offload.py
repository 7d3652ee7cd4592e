"""The connector's save path computes each block's MAC (BlockCodec.header) once, on its I/O
thread's loop (just before the block is sent), never on the engine thread that staged it, and
what it stores verifies."""

import threading
from dataclasses import dataclass, field

import torch

from pdserve.connector.codec import BlockCodec
from pdserve.connector.store import InMemoryBlockStore
from pdserve.connector.staging import staged_blocks
from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector


@dataclass(frozen=True)
class _Recording(BlockCodec):
    threads: list = field(default_factory=list, compare=False, repr=False)

    def header(self, key, payload):
        self.threads.append(threading.current_thread().name)
        return super().header(key, payload)


async def _thread_name() -> str:
    return threading.current_thread().name


def test_save_macs_on_the_io_loop_once_per_block_and_the_blocks_verify():
    codec = _Recording("0f" * 32, 2, 4, 2, 8)
    store = InMemoryBlockStore()
    conn = StoreKVConnector(store, codec, ConnectorConfig(role="producer"))
    keys = [bytes([i]) * 32 for i in range(3)]
    blocks = [torch.randn(codec.payload_shape) for _ in keys]
    buf = bytearray(len(keys) * codec.nbytes)
    for j, block in enumerate(blocks):  # staged as save_layer leaves them: payloads only
        codec.write_payload(block, memoryview(buf)[j * codec.nbytes:])
    try:
        with conn._lock:
            for _ in keys:
                conn._save_started("r")
        blocks_in = staged_blocks(conn.segments, keys, [buf])
        conn.io.run(conn._put_blocks(blocks_in, ["r"] * len(keys)), timeout=30)
        assert conn.get_finished()[0] == {"r"}
        assert len(codec.threads) == len(keys)
        io_loop = conn.io.run(_thread_name(), timeout=30)
        assert io_loop != threading.current_thread().name
        assert codec.threads == [io_loop] * len(keys)
        for key, block in zip(keys, blocks):
            got = codec.decode(key, memoryview(bytearray(store.objects[key])))
            assert torch.equal(got, block)
    finally:
        conn.close()
