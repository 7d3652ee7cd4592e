"""`python -m pdserve.bench.kv_save`: the connector's save of one prefill's blocks, alone.

A StoreKVConnector (producer) puts `--blocks` SmolLM2-135M blocks (16 tokens, fp32: 737,408
bytes each; 128 blocks are a 2,048-token prompt, 94 MB) through the real store client into a
real master (a local redis-server, a store secret: capabilities on) and one storage node,
all in this process (the node serves on threads of its own). Each repetition puts fresh keys
from the same staged buffer, headers (MACs) included, and is timed from `_put_blocks` to its
end: what the prefill instance waits for after its forward, without the engine around it.
Run the code before a change with its own PYTHONPATH to compare. The last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time

MiB = 1 << 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.kv_save")
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if args.blocks < 1 or args.reps < 1:
        raise ValueError("--blocks and --reps must be >= 1")
    import torch

    torch.set_num_threads(1)
    from pdserve.services.kvstore.redis_proc import RedisProcess

    with tempfile.TemporaryDirectory() as tmp, RedisProcess() as redis:
        secret = os.path.join(tmp, "store.secret")
        with open(secret, "w") as f:
            f.write(os.urandom(32).hex())
        os.chmod(secret, 0o600)
        times = _run(redis.url, secret, args.blocks, args.reps)
    nbytes = args.blocks * 737408
    med = statistics.median(times)
    print(f"{args.blocks} blocks ({nbytes / 1e6:.0f} MB): median {med * 1e3:.0f} ms "
          f"({nbytes / med / 1e6:.0f} MB/s); runs {[round(t * 1e3) for t in times]} ms")
    print(json.dumps({"bench": "kv_save", "blocks": args.blocks, "bytes": nbytes,
                      "median_s": round(med, 4), "runs_s": [round(t, 4) for t in times],
                      "mb_per_s": round(nbytes / med / 1e6, 1)}))
    return 0


def _run(redis_url: str, secret: str, blocks: int, reps: int) -> list[float]:
    import torch

    from pdserve.connector.codec import BlockCodec
    from pdserve.connector.kvstore.client import KVStoreClient, StoreClientConfig
    from pdserve.connector.staging import staged_blocks
    from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector
    from pdserve.services.kvstore.config import MasterConfig, NodeConfig
    from pdserve.services.kvstore.master_service import start_master
    from pdserve.services.kvstore.node import start_node

    codec = BlockCodec("0f" * 32, 30, 16, 3, 64)  # SmolLM2-135M, fp32
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)
    master = on_loop(start_master(MasterConfig(port=0, redis_url=redis_url,
                                               store_secret_file=secret)))
    maddr = f"127.0.0.1:{master.port}"
    node = on_loop(start_node(NodeConfig(master_addr=maddr, node_id="n0", transport="tcp",
                                         capacity=(reps + 1) * blocks * codec.nbytes,
                                         store_secret_file=secret)))
    conn = StoreKVConnector(None, codec, ConnectorConfig(role="producer"))

    async def client():
        return KVStoreClient(maddr, config=StoreClientConfig(transport="tcp"))
    try:
        conn.store = conn.io.run(client(), 10)
        buf = bytearray(blocks * codec.nbytes)
        for j in range(blocks):
            codec.write_payload(torch.randn(codec.payload_shape),
                                memoryview(buf)[j * codec.nbytes:])
        times = []
        for _ in range(reps):
            keys = [os.urandom(32) for _ in range(blocks)]
            with conn._lock:
                conn._save_started("bench")
            t0 = time.perf_counter()
            conn.io.run(conn._put_blocks(staged_blocks(conn.segments, keys, [buf]), ["bench"]),
                        60)
            times.append(time.perf_counter() - t0)
        if conn.stats.blocks_saved != reps * blocks:
            raise RuntimeError(f"only {conn.stats.blocks_saved} of {reps * blocks} blocks "
                               f"stored: {conn.stats.failure_reasons}")
        conn.io.run(conn.store.close(), 10)
        return times
    finally:
        conn.close()
        on_loop(node.stop())
        on_loop(master.stop(0))
        loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    raise SystemExit(main())
