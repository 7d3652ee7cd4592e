"""The thread-per-connection TCP listener (connector/transport/tcp_threads.py), as a storage
node runs it: a segment with capabilities, concurrent clients, a peer that stalls or stops
mid-payload, refused and oversized frames, the connection (so thread) limit, and close."""

import asyncio
import socket
import threading
import time

import numpy as np
import pytest

from pdserve.connector.kvstore.auth import sign_capability
from pdserve.connector.kvstore.node_protocol import READ, WRITE, NodeOp
from pdserve.connector.transport import RemoteError, TransportError, framing
from pdserve.connector.transport.tcp import TcpTransport
from pdserve.services.kvstore.segment import GrantCheck, Segment, SegmentHandler

KEY = b"g" * 32
CAP = 1 << 20


def _op(op, offset, length, key=KEY):
    return NodeOp(op, offset, length,
                  sign_capability(key, op, "n0", offset, length, time.time() + 60)).encode()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _node(**kw):
    seg = Segment(CAP)
    lst = await TcpTransport().listen_threads("127.0.0.1", 0,
                                              SegmentHandler(seg, GrantCheck(KEY, "n0")), **kw)
    return seg, lst


def _on_node(body, **kw):
    """Run `body(segment, listener)` against a live threaded listener, then close it."""
    async def main():
        seg, lst = await _node(**kw)
        try:
            await body(seg, lst)
        finally:
            await lst.close()
    _run(main())


async def _until(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _closed(sock) -> bool:
    """The peer closes the connection (after an error frame, if any: drained here)."""
    sock.settimeout(10)
    try:
        for _ in range(100):
            if sock.recv(65536) == b"":
                return True
    except ConnectionResetError:
        return True
    return False


def _recv_frame(sock):
    prefix = sock.recv(framing.PREFIX.size, socket.MSG_WAITALL)
    kind, hlen, plen = framing.PREFIX.unpack(prefix)
    return kind, sock.recv(hlen, socket.MSG_WAITALL) if hlen else b"", plen


def test_concurrent_clients_write_and_read_their_ranges():
    n, clients = 64 << 10, 8
    data = np.random.default_rng(0).integers(0, 256, n * clients, dtype=np.uint8)

    async def one(lst, i):
        conn = await TcpTransport().connect(lst.address)
        try:
            for _ in range(3):
                await conn.request(_op(WRITE, i * n, n), data[i * n:(i + 1) * n])
                out = memoryview(bytearray(n))
                await conn.request(_op(READ, i * n, n), out=out)
                assert bytes(out) == data[i * n:(i + 1) * n].tobytes()
        finally:
            await conn.close()

    async def body(seg, lst):
        await asyncio.gather(*(one(lst, i) for i in range(clients)))
        assert np.array_equal(seg.view[:n * clients], data)
        await _until(lambda: lst.connections == 0)  # every thread ended with its client
    _on_node(body)


def test_a_refused_write_lands_nothing_and_keeps_serving():
    async def body(seg, lst):
        conn = await TcpTransport().connect(lst.address)
        forged = _op(WRITE, 0, 4096, key=b"x" * 32)
        with pytest.raises(RemoteError, match="refused"):
            await conn.request(forged, b"\xff" * 4096)
        assert not seg.view[:4096].tobytes().strip(b"\0")
        with pytest.raises(TransportError):  # its payload was left unread: closed
            await conn.request(_op(WRITE, 0, 4), b"abcd")
        conn = await TcpTransport().connect(lst.address)
        with pytest.raises(RemoteError, match="refused"):  # no payload: kept
            await conn.request(_op(READ, CAP - 8, 8, key=b"x" * 32), out=memoryview(
                bytearray(8)))
        await conn.request(_op(WRITE, 0, 4), b"abcd")
        assert seg.view[:4].tobytes() == b"abcd"
        await conn.close()
    _on_node(body)


@pytest.mark.parametrize("frame", [
    framing.PREFIX.pack(framing.KIND_REQUEST, framing.MAX_HEADER + 1, 0),
    framing.PREFIX.pack(framing.KIND_OK, 1, 0) + b"h",
    framing.PREFIX.pack(framing.KIND_REQUEST, 1, 2**62) + b"h",  # undecodable header
])
def test_oversized_or_corrupt_frames_close_only_their_connection(frame):
    async def body(seg, lst):
        def attack():
            with socket.create_connection(("127.0.0.1", lst.port), timeout=10) as s:
                s.sendall(frame)
                assert _closed(s)
        await asyncio.to_thread(attack)
        conn = await TcpTransport().connect(lst.address)
        await conn.request(_op(WRITE, 0, 3), b"xyz")
        await conn.close()
    _on_node(body)


def test_a_huge_claimed_payload_gets_an_error_frame_before_any_allocation():
    async def body(_, lst):
        def attack():
            with socket.create_connection(("127.0.0.1", lst.port), timeout=10) as s:
                s.sendall(framing.pack(framing.KIND_REQUEST, _op(WRITE, 0, 2**40), 2**40))
                kind, header, plen = _recv_frame(s)
                assert kind == framing.KIND_ERROR and b"outside the segment" in header
                assert _closed(s)
        await asyncio.to_thread(attack)
    _on_node(body)


def test_a_peer_that_stalls_mid_payload_is_dropped_after_the_frame_timeout():
    async def body(seg, lst):
        s = socket.create_connection(("127.0.0.1", lst.port))
        s.sendall(framing.pack(framing.KIND_REQUEST, _op(WRITE, 0, 8192), 8192) + b"a" * 100)
        await _until(lambda: lst.connections == 1)
        t0 = time.monotonic()
        await _until(lambda: lst.connections == 0)  # dropped, its thread ended
        assert time.monotonic() - t0 < 5
        assert await asyncio.to_thread(_closed, s)
        s.close()
    _on_node(body, frame_timeout_s=0.3)


def test_an_idle_connection_outlives_the_frame_timeout_and_a_peer_may_vanish_mid_payload():
    async def body(_, lst):
        conn = await TcpTransport().connect(lst.address)
        await asyncio.sleep(0.5)  # idle between requests: not a stall
        await conn.request(_op(WRITE, 0, 2), b"ok")
        s = socket.create_connection(("127.0.0.1", lst.port))
        s.sendall(framing.pack(framing.KIND_REQUEST, _op(WRITE, 0, 1 << 19), 1 << 19)
                  + bytes(1 << 18))
        s.close()  # stops mid-payload
        await _until(lambda: lst.connections == 1)  # only the idle client is left
        await conn.request(_op(WRITE, 2, 2), b"ok")
        await conn.close()
    _on_node(body, frame_timeout_s=0.2)


def test_connections_beyond_the_limit_are_closed_on_accept():
    async def body(_, lst):
        conns = [await TcpTransport().connect(lst.address) for _ in range(2)]
        for c in conns:
            await c.request(_op(WRITE, 0, 1), b"x")
        extra = socket.create_connection(("127.0.0.1", lst.port))
        assert await asyncio.to_thread(_closed, extra)
        extra.close()
        assert lst.connections == 2
        await conns.pop().close()
        await _until(lambda: lst.connections == 1)
        again = await TcpTransport().connect(lst.address)
        await again.request(_op(WRITE, 0, 1), b"y")
        await asyncio.gather(again.close(), conns[0].close())
    _on_node(body, max_connections=2)


def test_close_ends_every_thread_even_with_clients_connected():
    async def main():
        _, lst = await _node()
        conns = [await TcpTransport().connect(lst.address) for _ in range(3)]
        for c in conns:
            await c.request(_op(WRITE, 0, 1), b"x")
        ours = [t for t in threading.enumerate() if t.name.startswith("tcp-")]
        assert len(ours) == 4  # the acceptor and one thread per connection
        await lst.close()
        assert lst.connections == 0 and not any(t.is_alive() for t in ours)
        for c in conns:
            with pytest.raises(TransportError):
                await c.request(_op(WRITE, 0, 1), b"x")
    _run(main())
