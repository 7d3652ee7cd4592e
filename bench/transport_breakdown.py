"""`pdserve bench transport --breakdown`: what one put of `size` bytes costs, part by part.

Each part is timed alone on this process's thread (medians of `reps`): the block MAC
(BlockCodec.header: HMAC-SHA256 one-time key + GMAC over the payload) per object and per
GB, over one cache-hot buffer and over 256 MiB of distinct ones (a step's staging buffers
are not in this core's cache when they are put); the hand-off of a call to a worker thread and back (run_in_executor, an empty call:
what every offloaded MAC pays on top of its work); signing and checking a capability (the
master signs one per replica, the node checks it before a byte lands); a memcpy of the
payload (loopback TCP copies each byte twice: into the socket, out of it); and, where a
redis-server is installed, the master's round trips per object against a real master
process with a store secret: PutStart + PutEnd one object at a time, against one
BatchPutStart + BatchPutEnd for a batch. The transport contenders' round trip (`rtt_us`)
completes the picture.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MiB = 1 << 20


def _median_us(fn, iters: int, reps: int) -> float:
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(runs)


def local_parts(sizes, reps: int) -> dict:
    """MAC and memcpy per size; hand-off and capability costs once."""
    from pdserve.bench.transport_store import GRANT_KEY, mac_codec
    from pdserve.connector.kvstore.auth import check_capability, sign_capability
    from pdserve.connector.kvstore.node_protocol import WRITE

    codec = mac_codec("mac")
    data = memoryview(np.random.default_rng(1).integers(0, 255, max(sizes), dtype=np.uint8))
    dst = memoryview(np.empty(max(sizes), dtype=np.uint8))
    per_size = {}
    for size in sizes:
        iters = max(2, min(200, (64 * MiB) // size))
        mac = _median_us(lambda: codec.header(b"k" * 32, data[:size]), iters, reps)
        cold = _cold_mac_us(codec, size, reps)

        def copy():
            dst[:size] = data[:size]
        cp = _median_us(copy, iters, reps)
        per_size[size] = {"mac_us": mac, "mac_gbps": size / mac / 1e3,
                          "mac_cold_us": cold, "mac_cold_gbps": size / cold / 1e3,
                          "memcpy_us": cp, "memcpy_gbps": size / cp / 1e3}
    cap = sign_capability(GRANT_KEY, WRITE, "bench", 0, 4096, time.time() + 60)
    return {
        "per_size": per_size,
        "handoff_us": _handoff_us(reps),
        "cap_sign_us": _median_us(lambda: sign_capability(
            GRANT_KEY, WRITE, "bench", 0, 4096, time.time() + 60), 5000, reps),
        "cap_check_us": _median_us(lambda: check_capability(
            GRANT_KEY, WRITE, "bench", 0, 4096, cap, time.time(), 2.0), 5000, reps),
    }


def _cold_mac_us(codec, size: int, reps: int, ring_bytes: int = 256 * MiB) -> float:
    """The MAC of one object read from memory: each call on another of the ring's buffers."""
    ring = [memoryview(np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8))
            for i in range(max(2, ring_bytes // size))]
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for view in ring:
            codec.header(b"k" * 32, view)
        runs.append((time.perf_counter() - t0) / len(ring) * 1e6)
    return statistics.median(runs)


def _handoff_us(reps: int, iters: int = 2000) -> float:
    pool = concurrent.futures.ThreadPoolExecutor(1)

    async def run() -> float:
        loop, runs = asyncio.get_running_loop(), []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(iters):
                await loop.run_in_executor(pool, int)
            runs.append((time.perf_counter() - t0) / iters * 1e6)
        return statistics.median(runs)
    try:
        return asyncio.run(run())
    finally:
        pool.shutdown()


def master_parts(batch: int, reps: int) -> dict | None:
    """us per object of the master's calls, one object at a time vs batched (None without
    a redis-server)."""
    if shutil.which("redis-server") is None:
        return None
    from pdserve.services.kvstore.redis_proc import RedisProcess
    from pdserve.services.launcher import Child, free_port

    with tempfile.TemporaryDirectory() as tmp, RedisProcess() as redis:
        secret = Path(tmp) / "store.secret"
        secret.write_text(secrets.token_hex(32))
        secret.chmod(0o600)
        port = free_port("127.0.0.1")
        master = Child("master", [sys.executable, "-m", "pdserve.services.kvstore.cli",
                                  "kvstore-master", "--port", str(port), "--redis-url",
                                  redis.url, "--store-secret-file", str(secret)], Path(tmp))
        master.start()
        try:
            return asyncio.run(_time_master(f"127.0.0.1:{port}", str(secret), batch, reps))
        finally:
            master.stop(5.0)


async def _time_master(maddr: str, secret_file: str, batch: int, reps: int) -> dict:
    import grpc

    from pdserve.common.rpc import kvstore_pb2 as pb
    from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
    from pdserve.connector.kvstore import convert
    from pdserve.connector.kvstore.auth import (load_store_keys, register_body,
                                                sign_token)
    from pdserve.connector.kvstore.records import NodeInfo

    keys = load_store_keys(secret_file)
    async with grpc.aio.insecure_channel(maddr) as ch:
        stub = pb_grpc.KVStoreMasterStub(ch)
        node = NodeInfo("bench", "127.0.0.1:1", 1 << 30, "inc")
        req = convert.node_to_pb(node)
        for _ in range(100):  # the master process is starting
            try:
                req.auth = sign_token(keys.register, b"register", register_body(node),
                                      time.time())
                await stub.RegisterNode(req, timeout=1)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
        single, batched, n = [], [], 0
        for _ in range(reps):
            names = [b"%032d" % (n + i) for i in range(batch)]
            n += batch
            t0 = time.perf_counter()
            for k in names:
                await stub.PutStart(pb.PutStartRequest(key=k, size=737408, lease_s=1))
                await stub.PutEnd(pb.PutEndRequest(key=k))
            single.append((time.perf_counter() - t0) / batch * 1e6)
            names = [b"%032d" % (n + i) for i in range(batch)]
            n += batch
            t0 = time.perf_counter()
            await stub.BatchPutStart(pb.BatchPutStartRequest(entries=[
                pb.PutStartRequest(key=k, size=737408, lease_s=1) for k in names]))
            await stub.BatchPutEnd(pb.BatchPutEndRequest(keys=names))
            batched.append((time.perf_counter() - t0) / batch * 1e6)
    return {"batch": batch, "single_us_per_object": statistics.median(single),
            "batched_us_per_object": statistics.median(batched)}


def print_breakdown(parts: dict, master: dict | None, rtt_us: dict, label) -> None:
    print("Breakdown of a put (each part alone, medians):")
    print(f"{'payload':>10} {'MAC us':>9} {'MAC GB/s':>9} {'cold MAC us':>12} "
          f"{'cold GB/s':>10} {'memcpy us':>10} {'memcpy GB/s':>12}")
    for size, p in parts["per_size"].items():
        print(f"{label(size) + ' MiB':>10} {p['mac_us']:>9.1f} {p['mac_gbps']:>9.2f} "
              f"{p['mac_cold_us']:>12.1f} {p['mac_cold_gbps']:>10.2f} "
              f"{p['memcpy_us']:>10.1f} {p['memcpy_gbps']:>12.2f}")
    print(f"worker hand-off (empty call): {parts['handoff_us']:.1f} us; capability sign "
          f"{parts['cap_sign_us']:.2f} us, check {parts['cap_check_us']:.2f} us")
    if rtt_us:
        print("transport round trip (empty request): "
              + ", ".join(f"{k} {v:.1f} us" for k, v in rtt_us.items()))
    if master is not None:
        print(f"master per object: PutStart+PutEnd one at a time "
              f"{master['single_us_per_object']:.0f} us, BatchPutStart+BatchPutEnd of "
              f"{master['batch']} {master['batched_us_per_object']:.0f} us")
    else:
        print("master round trips: not measured (no redis-server)")


def summary(parts: dict, master: dict | None, label) -> dict:
    return {
        "per_size": {label(s): {k: round(v, 2) for k, v in p.items()}
                     for s, p in parts["per_size"].items()},
        "handoff_us": round(parts["handoff_us"], 1),
        "cap_sign_us": round(parts["cap_sign_us"], 2),
        "cap_check_us": round(parts["cap_check_us"], 2),
        "master": None if master is None else {k: round(v, 1) for k, v in master.items()},
    }
