"""The `tcp+cap*` contenders of `pdserve bench transport`: the store's write path as the
connector drives it (connector/save_io.py, connector/kvstore/batch_put.py).

`--store-path batched` (the default): objects go in batches of `--batch-objects` (a step's
blocks), each object in its own buffer of a ring (the staging buffers), the way a put_many
sends them: each header (its block MAC) sealed on the loop just before its object goes out
(save_io.InlineSeals, the same class), a capability signed per object (as the master's
BatchPutStart grants each replica), and the node's WRITEs pipelined on one connection
(Connection.pipeline, the same call). The node checks
every capability before a byte lands; a refused write fails the benchmark. The master's two
round trips per batch are not part of this loop (no master runs here): `--breakdown`
measures them against a real master.

`--store-path single`: the path before batching: one WRITE in flight, answered before the
next; the next block's MAC computed on the worker during this one's send.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import time
from concurrent.futures import ThreadPoolExecutor

GRANT_KEY = b"bench-grant-key-0123456789abcdef"
MAC_KEY = b"bench-block-mac-0123456789abcdef"
HEADER = 128  # a block's header bytes (codec.HEADER_SIZE): the MAC is written there


class _Poly1305Header:
    """Format version 3's MAC: Poly1305 under a one-time key, as a codec's `header`."""

    def header(self, key: bytes, payload) -> bytes:
        from pdserve.connector.poly1305 import poly1305_tag

        otk = hmac.digest(MAC_KEY, b"pdkv-poly1305-otk\0" + os.urandom(16), hashlib.sha256)
        return poly1305_tag(otk, (bytes(HEADER), payload)).ljust(HEADER, b"\0")


class _GmacHeader:
    """Format version 4's MAC: GMAC (AES-256-GCM over associated data) under a one-time key."""

    def header(self, key: bytes, payload) -> bytes:
        from pdserve.connector.gmac import gmac_tag

        otk = hmac.digest(MAC_KEY, b"pdkv-gmac-otk\0" + os.urandom(16), hashlib.sha256)
        return gmac_tag(otk, (bytes(HEADER), payload)).ljust(HEADER, b"\0")


class _HmacHeader:
    """Format version 2's MAC: HMAC-SHA256 over the payload, as a codec's `header`."""

    def header(self, key: bytes, payload) -> bytes:
        return hmac.new(MAC_KEY, payload, hashlib.sha256).digest().ljust(HEADER, b"\0")


def mac_codec(mac_kind: str):
    """What writes a block's header for this contender (None: no MAC)."""
    if mac_kind == "mac":
        from pdserve.connector.codec import BlockCodec

        return BlockCodec("0f" * 32, 1, 1, 1, 1, mac_key=MAC_KEY)  # geometry unchecked here
    return {"gmac": _GmacHeader(), "poly1305": _Poly1305Header(),
            "hmac": _HmacHeader()}.get(mac_kind)


def write_header(size: int) -> bytes:
    """A NodeOp WRITE of `size` bytes at offset 0, with a capability signed for it."""
    from pdserve.connector.kvstore.auth import sign_capability
    from pdserve.connector.kvstore.node_protocol import WRITE, NodeOp

    cap = sign_capability(GRANT_KEY, WRITE, "bench", 0, size, time.time() + 60)
    return NodeOp(WRITE, 0, size, cap).encode()


def batched_sender(conn, mac_kind: str, batch: int):
    """send_many(ring, count): `count` objects from the ring's buffers, batch by batch."""
    from pdserve.connector.save_io import InlineSeals
    from pdserve.connector.transport import RemoteError

    codec = mac_codec(mac_kind)

    async def send_many(ring: list, count: int) -> None:
        for at in range(0, count, batch):
            views = [ring[(at + j) % len(ring)] for j in range(min(batch, count - at))]
            objs = [(b"k" * 32, v) for v in views]
            sealed = InlineSeals(codec, objs) if codec is not None else None

            async def ready(i: int) -> None:
                if sealed is not None:
                    await sealed[i]
            answers = await conn.pipeline([(write_header(len(v)), v) for v in views], ready)
            if any(isinstance(a, RemoteError) for a in answers):
                raise RuntimeError(f"the node refused a write: {answers}")
    send_many.close = lambda: None
    return send_many


def single_sender(conn, mac_kind: str):
    """send_many(ring, count): one WRITE at a time, each block's MAC one block ahead."""
    codec = mac_codec(mac_kind)
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(1, thread_name_prefix="bench-mac")
    pending = []  # the MAC of the block to send next, computed while this one is sent

    def mac(view):
        view[:HEADER] = codec.header(b"k" * 32, view[HEADER:])

    async def send_many(ring: list, count: int) -> None:
        for i in range(count):
            view = ring[i % len(ring)]
            if codec is not None:
                if pending:
                    await pending.pop()
                else:
                    mac(view)
                pending.append(loop.run_in_executor(pool, mac, ring[(i + 1) % len(ring)]))
            await conn.request(write_header(len(view)), view)
    send_many.close = pool.shutdown
    return send_many
