"""Frame limits on the TCP transport: a peer's length field never drives an allocation.

Both sides are attacked with hand-made frames over a raw socket: a server refuses an oversized
request with an error frame and closes only that connection; a client refuses an oversized
response with a TransportError (never a MemoryError) and drops the connection.
"""

import asyncio
import socket
import threading

import pytest

from pdserve.connector.transport import (FunctionHandler, RemoteError, TransportError,
                                         make_transport)
from pdserve.connector.transport import framing


async def _echo(header, payload):
    return header, bytes(payload)


def _recv_frame(sock: socket.socket) -> tuple[int, bytes, int]:
    prefix = _recv_n(sock, framing.PREFIX.size)
    kind, hlen, plen = framing.PREFIX.unpack(prefix)
    return kind, _recv_n(sock, hlen), plen


def _recv_n(sock, n) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _closed(sock) -> bool:
    """The peer closed the connection (an EOF, or a reset when it left our bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _served(handler, attack):
    """Run `attack(port)` (blocking, in a thread) against a live TCP listener, then check the
    listener still serves an ordinary request."""
    async def main():
        t = make_transport("tcp")
        lst = await t.listen("127.0.0.1", 0, handler)
        try:
            await asyncio.to_thread(attack, lst.port)
            conn = await t.connect(lst.address)
            m = await conn.request(b"ok", b"body")
            assert (m.header, bytes(m.payload)) == (b"ok", b"body")
            await conn.close()
        finally:
            await lst.close()
    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("claimed", [2**62, (1 << 30), framing.MAX_FRESH_PAYLOAD + 1])
def test_server_refuses_an_oversized_payload_before_allocating(claimed):
    def attack(port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(framing.pack(framing.KIND_REQUEST, b"h", claimed))
            kind, header, plen = _recv_frame(s)
            assert kind == framing.KIND_ERROR and b"FrameTooLarge" in header and plen == 0
            assert _closed(s)  # the unread payload made the stream unusable
    _served(FunctionHandler(_echo), attack)


def test_server_handler_limit_and_a_refusal_without_payload_keeps_the_connection():
    def attack(port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(framing.pack(framing.KIND_REQUEST, b"big", 101) + b"x" * 101)
            kind, header, _ = _recv_frame(s)
            assert kind == framing.KIND_ERROR and b"FrameRejected" in header
    _served(FunctionHandler(_echo, max_payload=100), attack)


@pytest.mark.parametrize("frame", [
    framing.PREFIX.pack(framing.KIND_REQUEST, framing.MAX_HEADER + 1, 0),  # header too long
    framing.PREFIX.pack(framing.KIND_OK, 1, 0) + b"h",  # a response sent as a request
    framing.PREFIX.pack(99, 0, 0),  # unknown kind
])
def test_server_drops_a_corrupt_prefix(frame):
    def attack(port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(frame)
            assert _closed(s)
    _served(FunctionHandler(_echo), attack)


def _rogue_server(reply: bytes):
    """A listening socket that answers any request prefix with `reply`; (port, thread)."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = lsock.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(reply)
            conn.recv(1)  # hold the connection until the client drops it
        lsock.close()
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return lsock.getsockname()[1], th


@pytest.mark.parametrize("reply,out", [
    (framing.PREFIX.pack(framing.KIND_OK, 0, 2**62), None),
    (framing.PREFIX.pack(framing.KIND_OK, 0, framing.MAX_FRESH_PAYLOAD + 1), None),
    (framing.PREFIX.pack(framing.KIND_OK, 0, 11), memoryview(bytearray(10))),
    (framing.PREFIX.pack(framing.KIND_OK, framing.MAX_HEADER + 1, 0), None),
    (framing.PREFIX.pack(framing.KIND_REQUEST, 0, 0), None),
])
def test_client_refuses_an_oversized_response(reply, out):
    port, th = _rogue_server(reply)

    async def main():
        conn = await make_transport("tcp").connect(f"127.0.0.1:{port}")
        with pytest.raises(TransportError, match="exceeds|unexpected frame kind"):
            await conn.request(b"READ", out=out)
        with pytest.raises(TransportError):  # the connection is dropped, not reused
            await conn.request(b"again")
        await conn.close()
    asyncio.run(asyncio.wait_for(main(), 30))
    th.join(10)


def test_remote_error_keeps_the_connection():
    async def boom(header, payload):
        raise KeyError("nope")

    async def main():
        t = make_transport("tcp")
        lst = await t.listen("127.0.0.1", 0, FunctionHandler(boom))
        try:
            conn = await t.connect(lst.address)
            for _ in range(2):
                with pytest.raises(RemoteError, match="KeyError"):
                    await conn.request(b"x")
            await conn.close()
        finally:
            await lst.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_tcp_connections_use_keepalive():
    async def main():
        t = make_transport("tcp")
        lst = await t.listen("127.0.0.1", 0, FunctionHandler(_echo))
        try:
            conn = await t.connect(lst.address)
            s = conn._sock
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
            await conn.close()
        finally:
            await lst.close()
    asyncio.run(asyncio.wait_for(main(), 30))
