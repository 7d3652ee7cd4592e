"""`pdserve bench transport`: KV transport throughput and round trip against a raw socket.

Each contender's server runs in its own process (a core of its own, as a storage node would)
and sinks payloads into a preallocated buffer; the client sends `size` payloads one after the
other on one connection, each answered by a tiny ack before the next is sent (the put
direction: one request in flight, for every contender). Figures are medians over
repetitions; the last line of output is one JSON object (see `_summary`). Sizes: `--sizes-mib`
(fractions allowed) and `--sizes-bytes`, by default one encoded SmolLM2-135M block (16 tokens,
fp32: 737,408 bytes), the block the store moves most.

The contenders:

- `socket`: the baseline. Blocking `sendall` of an 8-byte length, `sendall` of the payload,
  `recv_into` of a 1-byte ack, over loopback; the server receives into its buffer.
- `tcp`: the KV transport (connector/transport/tcp.py, asyncio's non-blocking socket calls)
  on both sides, with a trivial handler that lands the payload in a preallocated buffer.
  Payloads of 64 KiB up to 1 MiB go out by reference (vmsplice+splice,
  connector/transport/splice.py) unless `--zero-copy off`, and are received with one
  wake-up per MiB (SO_RCVLOWAT).
- `ucx`: the same over UCX (ucxx), where it is installed.
- `tcp+cap`: the storage node's real write path with the store secret on. The server is a
  SegmentHandler over a Segment that checks the HMAC capability of every request before a
  byte of its payload lands, served as a node serves it (`listen_threads`: a thread per
  connection, blocking calls, connector/transport/tcp_threads.py). The client drives it as
  the connector's batched put does (bench/transport_store.py, `--store-path`): by default
  batches of `--batch-objects` objects, each in its own staging buffer, a capability signed
  per object, the WRITEs pipelined on one connection.
- `tcp+cap+mac`: `tcp+cap`, plus each block's MAC as the connector computes it on its save
  path (connector/save_io.py): BlockCodec.header (HMAC-SHA256 one-time key from a fresh
  nonce, then NH-Poly1305 over header and payload, connector/codec.py, format version 5), on
  the loop just before each object is sent (save_io.InlineSeals), so every MAC is inside the
  timed loop, overlapping the node's receive of the objects before it.
- `tcp+cap+gmac`, `tcp+cap+poly1305`, `tcp+cap+hmac`: the same with the previous
  constructions, for comparison: GMAC under a one-time key (format version 4,
  connector/gmac.py; holds the GIL), Poly1305 under a one-time key (format version 3,
  connector/poly1305.py) and HMAC-SHA256 over the payload (format version 2, hashlib; both
  release the GIL).

The MAC contenders write each block's header into its first 128 bytes and send `size` bytes
like the others. No contender talks to a master: the BatchPutStart/BatchPutEnd round trips
of a real put (two per batch) are outside the timed loop; `--breakdown` measures them (with a
real master on a local redis-server, where one is installed) next to the other parts of a
put: the MAC alone, a hand-off to a worker thread (what an offloaded MAC would pay), the
capability checks, the copies.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import time

import numpy as np

from pdserve.bench import transport_store
from pdserve.bench.offline import cpu_name

MiB = 1 << 20
_LEN = struct.Struct("!Q")
CONTENDERS = ("socket", "tcp", "tcp+cap", "tcp+cap+mac", "tcp+cap+gmac", "tcp+cap+poly1305",
              "tcp+cap+hmac", "ucx")
_GRANT_KEY, _MAC_KEY = transport_store.GRANT_KEY, transport_store.MAC_KEY
# 30 layers x (K, V) x 16 tokens x 3 KV heads x 64 dims x 4 bytes, plus the 128-byte header
SMOLLM2_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4 + 128


def add_transport_subcommand(sub) -> None:
    p = sub.add_parser("transport", help="UCX and TCP transports, and the store's write path "
                                         "as the connector drives it, vs a raw loopback socket")
    _add_args(p)
    p.set_defaults(func=_run)


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench transport")
    _add_args(p)
    return p.parse_args(argv)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", default="0.5,1,4,16,64",
                   help="payload sizes, MiB (fractions allowed)")
    p.add_argument("--sizes-bytes", default=str(SMOLLM2_BLOCK_BYTES),
                   help="more payload sizes, bytes (default: one encoded SmolLM2-135M block, "
                        "16 tokens in fp32 with its header)")
    p.add_argument("--bytes-per-rep-mib", type=int, default=128, help="data sent per repetition")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the contenders in turn this many times (each its --reps) and "
                        "report the median of the rounds: on a shared host, load that "
                        "comes and goes then falls on every contender alike")
    p.add_argument("--rtt-iters", type=int, default=2000)
    p.add_argument("--transports", default=",".join(CONTENDERS))
    p.add_argument("--zero-copy", choices=("on", "off"), default="on",
                   help="tcp contenders: send payloads by reference (vmsplice+splice, "
                        "Linux) or copy them (plain send)")
    p.add_argument("--ucx-progress-mode", default=None,
                   help="blocking|polling|thread|thread-polling; default: UcxConfig's")
    p.add_argument("--store-path", choices=("batched", "single"), default="batched",
                   help="tcp+cap contenders: the store path as the connector uses it (batched: "
                        "a step's objects, each sealed just before it is sent, their WRITEs "
                        "pipelined on one connection, each with its capability) or the "
                        "one-object-at-a-time path before batching")
    p.add_argument("--batch-objects", type=int, default=32,
                   help="objects per batch of the batched store path (a step's blocks)")
    p.add_argument("--buffers", type=int, default=1,
                   help="distinct payload buffers per size that every contender (the socket "
                        "too) sends in turn: 1 keeps the payload cache-hot for all, as "
                        "earlier figures; more (a step's staging buffers) reads cold memory")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the parts of a put per size: the MAC alone, the worker "
                        "hand-off, capability sign/check, memcpy, master round trips")


# ---- server side (child process) -------------------------------------------------------

def _raw_server(lsock: socket.socket, max_size: int) -> None:
    sink = memoryview(bytearray(max_size))
    conn, _ = lsock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = memoryview(bytearray(_LEN.size))
    while True:
        if not _recv_exact(conn, head):
            return
        (n,) = _LEN.unpack(head)
        _recv_exact(conn, sink[:n])
        conn.sendall(b"k")


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class _Sink:
    """Lands every payload in one preallocated buffer, as a storage node's segment would."""

    def __init__(self, max_size: int):
        self._buf = memoryview(np.empty(max_size, dtype=np.uint8)).cast("B")

    def payload_buffer(self, header: bytes, nbytes: int):
        return self._buf[:nbytes]

    async def handle(self, header: bytes, payload):
        return b"k", b""


def _server_main(kind: str, max_size: int, progress_mode: str, conn) -> None:
    if kind == "socket":
        lsock = socket.create_server(("127.0.0.1", 0))
        conn.send(lsock.getsockname()[1])
        _raw_server(lsock, max_size)
        return
    asyncio.run(_async_server(kind, max_size, progress_mode, conn))


async def _async_server(kind, max_size, progress_mode, conn) -> None:
    transport = _transport(kind, progress_mode)
    if kind.startswith("tcp+cap"):  # the storage node's listener and handler (node.py)
        from pdserve.services.kvstore.segment import GrantCheck, Segment, SegmentHandler

        handler = SegmentHandler(Segment(max_size), GrantCheck(_GRANT_KEY, "bench"))
        listener = await transport.listen_threads("127.0.0.1", 0, handler)
    else:
        listener = await transport.listen("127.0.0.1", 0, _Sink(max_size))
    conn.send(listener.port)
    await asyncio.Event().wait()  # until the parent terminates us


def _transport(kind: str, progress_mode: str, zero_copy: bool = True):
    from pdserve.connector.transport.tcp import TcpTransport
    from pdserve.connector.transport.ucx import UcxConfig, UcxTransport

    if kind == "ucx":
        return UcxTransport(UcxConfig(progress_mode=progress_mode) if progress_mode else None)
    return TcpTransport(zero_copy=zero_copy)


# ---- client side -----------------------------------------------------------------------

def _cpu_seconds(pids) -> float:
    """CPU time so far of every thread of these processes (Linux schedstat, ns resolution):
    what a transfer costs in CPU, whatever else the machine runs. 0.0 where unavailable."""
    total = 0
    for pid in pids:
        for task in glob.glob(f"/proc/{pid}/task/*/schedstat"):
            try:
                with open(task) as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):  # a thread that just ended
                pass
    return total / 1e9


async def _measure(send_many, sizes, args, cpu, rtt_send=None) -> dict:
    """Per payload size: median GB/s and median CPU (client + server, us per MiB); median
    small-message round trip (us). send_many(ring, count) sends `count` payloads taken in
    turn from `ring`, --buffers distinct buffers of the size (at most a repetition's)."""
    per_rep, reps, rtt_iters = args.bytes_per_rep_mib * MiB, args.reps, args.rtt_iters
    rng = np.random.default_rng(0)
    gbps, cpu_us = {}, {}
    for size in sizes:
        count = max(1, per_rep // size)
        ring = [memoryview(rng.integers(0, 255, size, dtype=np.uint8))
                for _ in range(max(1, min(args.buffers, count)))]
        await send_many(ring, len(ring))  # warm-up: connection set-up, page faults
        runs, cpus = [], []
        for _ in range(reps):
            c0, t0 = cpu(), time.perf_counter()
            await send_many(ring, count)
            runs.append(size * count / (time.perf_counter() - t0) / 1e9)
            cpus.append((cpu() - c0) / (size * count / MiB) * 1e6)
        gbps[size], cpu_us[size] = statistics.median(runs), statistics.median(cpus)
        del ring
    rtts = []
    empty = memoryview(b"")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(rtt_iters):
            await (rtt_send(empty) if rtt_send is not None else send_many([empty], 1))
        rtts.append((time.perf_counter() - t0) / rtt_iters * 1e6)
    return {"gbps": gbps, "cpu_us_per_mib": cpu_us, "rtt_us": statistics.median(rtts)}


def _one_at_a_time(send):
    """send_many over a per-payload send."""
    async def send_many(ring, count):
        for i in range(count):
            await send(ring[i % len(ring)])
    return send_many


async def _raw_client(port: int, args, sizes, cpu) -> dict:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = memoryview(bytearray(1))

    async def send(payload: memoryview) -> None:  # blocking on purpose: the bare syscalls
        s.sendall(_LEN.pack(len(payload)))
        s.sendall(payload)
        _recv_exact(s, ack)

    try:
        return await _measure(_one_at_a_time(send), sizes, args, cpu)
    finally:
        s.close()


async def _transport_client(kind: str, port: int, args, sizes, cpu) -> dict:
    conn = await _transport(kind, args.ucx_progress_mode, args.zero_copy == "on").connect(
        f"127.0.0.1:{port}")
    if not kind.startswith("tcp+cap"):
        async def send(payload: memoryview) -> None:
            await conn.request(b"put", payload)
        try:
            return await _measure(_one_at_a_time(send), sizes, args, cpu)
        finally:
            await conn.close()
    store = transport_store
    mac_kind = kind.rpartition("+")[2]
    batched = args.store_path == "batched"
    send_many = (store.batched_sender(conn, mac_kind, args.batch_objects) if batched
                 else store.single_sender(conn, mac_kind))

    async def rtt_send(payload: memoryview) -> None:  # a capability-checked empty WRITE
        await conn.request(store.write_header(0), payload)
    try:
        return await _measure(send_many, sizes, args, cpu, rtt_send=rtt_send)
    finally:
        send_many.close()
        await conn.close()


def _codec_mac():
    """The block header the producer writes: the tcp+cap+mac contender's MAC."""
    codec = transport_store.mac_codec("mac")
    return lambda payload: codec.header(b"k" * 32, payload)


def _run_one(kind: str, args, sizes) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server_main, args=(kind, max(sizes), args.ucx_progress_mode, child),
                       daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError(f"{kind} bench server did not start")
        port = parent.recv()
        client = _raw_client if kind == "socket" else (
            lambda *a: _transport_client(kind, *a))
        pids = (os.getpid(), proc.pid)
        return asyncio.run(client(port, args, sizes, lambda: _cpu_seconds(pids)))
    finally:
        proc.terminate()
        proc.join(10)


# ---- report ----------------------------------------------------------------------------

def _summary(results: dict, sizes) -> dict:
    base = results.get("socket")
    ratios, cpu_ratios = {}, {}
    if base:
        for kind, res in results.items():
            if kind != "socket":
                ratios[kind] = {_label(s): res["gbps"][s] / base["gbps"][s] for s in sizes}
                cpu_ratios[kind] = {_label(s): res["cpu_us_per_mib"][s]
                                    / max(base["cpu_us_per_mib"][s], 1e-9) for s in sizes}
    big = [r for per in ratios.values() for r in per.values()]

    def per_size(field: str, digits: int) -> dict:
        return {k: {_label(s): round(v[field][s], digits) for s in sizes}
                for k, v in results.items()}

    return {
        "bench": "transport",
        "cpu": f"{cpu_name()} x{mp.cpu_count()}",
        "gbps": per_size("gbps", 3),
        "cpu_us_per_mib": per_size("cpu_us_per_mib", 1),
        "rtt_us": {k: round(v["rtt_us"], 1) for k, v in results.items()},
        "ratio_vs_socket": {k: {s: round(r, 3) for s, r in v.items()} for k, v in ratios.items()},
        "cpu_ratio_vs_socket": {k: {s: round(r, 3) for s, r in v.items()}
                                for k, v in cpu_ratios.items()},
        "min_ratio_by_transport": {k: round(min(v.values()), 3) for k, v in ratios.items()},
        "min_ratio_vs_socket": round(min(big), 3) if big else None,
    }


def _label(size: int) -> str:
    """A size as the report names it: MiB, to 3 decimals where it is not whole."""
    mib = size / MiB
    return str(int(mib)) if mib == int(mib) else f"{mib:.3f}"


def _print_table(summary: dict, sizes) -> None:
    kinds = list(summary["gbps"])
    print(f"{'payload':>10} " + " ".join(f"{k + ' GB/s':>11}" for k in kinds)
          + "".join(f" {k + '/socket':>12}" for k in summary["ratio_vs_socket"]))
    _print_rows(summary["gbps"], summary["ratio_vs_socket"], sizes, 3)
    print(f"{'rtt (us)':>10} " + " ".join(f"{summary['rtt_us'][k]:>11.1f}" for k in kinds))
    print("CPU us per MiB (client + server), and its ratio to the socket's:")
    _print_rows(summary["cpu_us_per_mib"], summary["cpu_ratio_vs_socket"], sizes, 1)
    print(f"cpu: {summary['cpu']}")


def _print_rows(values: dict, ratios: dict, sizes, digits: int) -> None:
    """One row per size: each contender's value, then each ratio to the socket."""
    for s in sizes:
        mib = _label(s)
        row = f"{mib + ' MiB':>10} " + " ".join(f"{v[mib]:>11.{digits}f}"
                                                  for v in values.values())
        print(row + "".join(f" {v[mib]:>12.2f}" for v in ratios.values()))


def main(argv=None) -> int:
    return _run(_parse(argv))


def _run(args: argparse.Namespace) -> int:
    try:
        import torch

        torch.set_num_threads(1)  # nothing here computes; keep torch off the shared cores
    except ImportError:
        pass
    sizes = sorted({round(float(x) * MiB) for x in args.sizes_mib.split(",") if x}
                   | {int(x) for x in args.sizes_bytes.split(",") if x})
    if not sizes or min(sizes) < 1:
        raise ValueError("every payload size must be at least one byte")
    kinds = [k for k in args.transports.split(",") if k]
    unknown = set(kinds) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"unknown transports {sorted(unknown)}; choose from {CONTENDERS}")
    if args.batch_objects < 1 or args.buffers < 1:
        raise ValueError("--batch-objects and --buffers must be >= 1")
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    rounds = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            rounds[kind].append(_run_one(kind, args, sizes))
    results = {kind: _median_of_rounds(runs) for kind, runs in rounds.items()}
    summary = _summary(results, sizes)
    summary["rounds"] = args.rounds
    summary["store_path"] = {"mode": args.store_path, "batch_objects": args.batch_objects,
                             "buffers": args.buffers}
    _print_table(summary, sizes)
    if args.breakdown:
        summary["breakdown"] = _breakdown(args, sizes, summary["rtt_us"])
    print(json.dumps(summary))
    return 0


def _median_of_rounds(runs: list[dict]) -> dict:
    """One contender's result: per size and field, the median over rounds."""
    return {"gbps": {s: statistics.median(r["gbps"][s] for r in runs) for s in runs[0]["gbps"]},
            "cpu_us_per_mib": {s: statistics.median(r["cpu_us_per_mib"][s] for r in runs)
                               for s in runs[0]["cpu_us_per_mib"]},
            "rtt_us": statistics.median(r["rtt_us"] for r in runs)}


def _breakdown(args, sizes, rtt_us: dict) -> dict:
    from pdserve.bench import transport_breakdown as bd

    parts = bd.local_parts(sizes, args.reps)
    master = bd.master_parts(args.batch_objects, args.reps)
    bd.print_breakdown(parts, master, rtt_us, _label)
    return bd.summary(parts, master, _label)


if __name__ == "__main__":
    raise SystemExit(main())
