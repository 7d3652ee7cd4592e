"""The TCP transport's zero-copy send (vmsplice+splice) and its bulk receive (SO_RCVLOWAT):
the bytes arrive intact whatever the buffer's kind, alignment and size; a peer that stops
mid-payload breaks only that connection; a request given up mid-send never delivers the rest
of its payload (the caller may reuse the buffer by then)."""

import asyncio
import socket
import sys
import threading

import numpy as np
import pytest

from pdserve.connector.transport import TransportError, framing
from pdserve.connector.transport.splice import (MIN_SPLICE_BYTES, PIPE_BYTES, Splicer,
                                                spliced)
from pdserve.connector.transport.tcp import TcpTransport
from tests.unit.test_transport_roundtrip import _Landing as _Sink  # lands in place, answers ok

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="vmsplice is Linux")


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@linux_only
def test_the_splice_path_is_available_here():
    s = Splicer.open()
    assert s is not None and s.capacity >= 64 << 10
    s.close()


def test_payloads_from_64_kib_up_to_1_mib_are_spliced_the_rest_copied():
    assert [spliced(n) for n in (MIN_SPLICE_BYTES - 1, MIN_SPLICE_BYTES, 737_408,
                                 PIPE_BYTES - 1, PIPE_BYTES, 3 * PIPE_BYTES)] == [
        False, True, True, True, False, False]


@linux_only
def test_a_splice_in_several_pipe_rounds_lands_intact():
    """Splicer.send on its own: a payload three times the pipe's size goes in rounds."""
    data = np.random.default_rng(7).integers(0, 256, 3 * PIPE_BYTES + 5, dtype=np.uint8)
    a, b = socket.socketpair()
    got = bytearray()

    def drain():
        while len(got) < len(data):
            got.extend(b.recv(1 << 20))
    th = threading.Thread(target=drain, daemon=True)
    th.start()
    a.setblocking(False)
    s = Splicer.open()

    async def main():
        await s.send(asyncio.get_running_loop(), a, memoryview(data))
    try:
        _run(main())
        th.join(30)
        assert bytes(got) == data.tobytes()
    finally:
        s.close()
        a.close()
        b.close()


@linux_only
@pytest.mark.parametrize("n,offset", [(MIN_SPLICE_BYTES, 0), (MIN_SPLICE_BYTES + 1, 3),
                                      (PIPE_BYTES - 1, 1), (3 * PIPE_BYTES, 0),
                                      (737_408, 128)])
@pytest.mark.parametrize("kind", ["bytes", "bytearray", "numpy"])
def test_spliced_payloads_land_intact(n, offset, kind):
    data = np.random.default_rng(n).integers(0, 256, n + offset, dtype=np.uint8)
    payload = {"bytes": lambda: memoryview(data.tobytes())[offset:],  # read-only
               "bytearray": lambda: memoryview(bytearray(data.tobytes()))[offset:],
               "numpy": lambda: data[offset:]}[kind]()
    sink = _Sink(n + offset)

    async def main():
        lst = await TcpTransport().listen("127.0.0.1", 0, sink)
        conn = await TcpTransport(zero_copy=True).connect(lst.address)
        try:
            for _ in range(2):  # the pipe is empty again between requests
                sink.buf[:] = 0
                assert (await conn.request(b"w", payload)).header == b"ok"
                assert np.array_equal(sink.buf[:n], data[offset:])
        finally:
            await conn.close()
            await lst.close()
    _run(main())


def test_a_response_stopping_mid_payload_breaks_only_that_connection():
    """The client's bulk receive: a peer that announces 4 MiB and sends half, then closes."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = lsock.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(framing.PREFIX.pack(framing.KIND_OK, 0, 4 << 20) + bytes(2 << 20))
        lsock.close()
    th = threading.Thread(target=serve, daemon=True)
    th.start()

    async def main():
        conn = await TcpTransport().connect(f"127.0.0.1:{lsock.getsockname()[1]}")
        with pytest.raises(TransportError, match="closed by peer"):
            await conn.request(b"R", out=memoryview(bytearray(4 << 20)))
        with pytest.raises(TransportError):
            await conn.request(b"again")
    _run(main())
    th.join(10)


def test_a_request_payload_stopping_midway_leaves_the_listener_serving():
    """The server's bulk receive: a client announces 4 MiB, sends half and closes; the
    listener drops that connection and serves the next one."""
    sink = _Sink(4 << 20)

    async def main():
        lst = await TcpTransport().listen("127.0.0.1", 0, sink)
        try:
            def attack():
                with socket.create_connection(("127.0.0.1", lst.port), timeout=10) as s:
                    s.sendall(framing.pack(framing.KIND_REQUEST, b"w", 4 << 20) + bytes(2 << 20))
            await asyncio.to_thread(attack)
            conn = await TcpTransport().connect(lst.address)
            assert (await conn.request(b"w", bytes(1 << 20))).header == b"ok"
            await conn.close()
        finally:
            await lst.close()
    _run(main())


@linux_only
def test_a_request_given_up_mid_send_never_delivers_the_rest():
    """A peer that reads nothing: the request times out with most of its 16 MiB still queued;
    the connection is reset, so the peer never gets the payload (nor bytes the caller changes
    after it has its buffer back)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    accepted, gave_up, got = threading.Event(), threading.Event(), []

    def serve():
        conn, _ = lsock.accept()
        accepted.set()
        with conn:
            gave_up.wait(10)  # reads only once the client has its buffer back
            conn.settimeout(10)
            total = 0
            try:
                while chunk := conn.recv(1 << 20):
                    total += len(chunk)
            except ConnectionResetError:
                got.append("reset")
            got.append(total)
        lsock.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    n = 16 << 20

    async def main():
        conn = await TcpTransport(zero_copy=True).connect(f"127.0.0.1:{lsock.getsockname()[1]}")
        await asyncio.to_thread(accepted.wait, 10)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(conn.request(b"w", bytes(n)), 0.5)
        gave_up.set()
        await conn.close()
    _run(main())
    th.join(15)
    assert got[0] == "reset" and got[1] < n


@linux_only
def test_a_payload_vmsplice_refuses_goes_by_copy(monkeypatch):
    """Memory vmsplice cannot map (simulated: it fails before taking a byte) is copied."""
    sink = _Sink(1 << 20)
    payload = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]

    async def main():
        lst = await TcpTransport().listen("127.0.0.1", 0, sink)
        conn = await TcpTransport(zero_copy=True).connect(lst.address)
        splicer = conn._splicer
        monkeypatch.setattr(splicer, "_vmsplice", lambda *a: -1)
        try:
            assert (await conn.request(b"w", payload)).header == b"ok"
            assert np.array_equal(sink.buf, payload)
        finally:
            await conn.close()
            await lst.close()
    _run(main())
