"""Both KV transports: round trips, zero-copy landing, large payloads, concurrency, errors."""

import asyncio

import numpy as np
import pytest

from pdserve.connector.transport import (FunctionHandler, RemoteError, TransportError,
                                         UcxUnavailable, make_transport, ucx_available)

KINDS = ["tcp", "ucx"]


def _transport(kind):
    if kind == "ucx" and not ucx_available()[0]:
        with pytest.raises(UcxUnavailable):  # a clear error, not a silent fallback
            make_transport("ucx")
        pytest.skip(f"ucx unavailable here: {ucx_available()[1]}")
    return make_transport(kind)


async def _echo(header, payload):
    if header == b"boom":
        raise KeyError("no such thing")
    return header[::-1], bytes(payload)


class _Landing:
    """Lands payloads in a caller-owned array, as a storage segment does."""

    def __init__(self, n):
        self.buf = np.zeros(n, dtype=np.uint8)

    def payload_buffer(self, header, nbytes):
        return memoryview(self.buf)[:nbytes]

    async def handle(self, header, payload):
        assert payload.obj is self.buf  # it landed in place: no copy
        return b"ok", memoryview(self.buf)[:len(payload)]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_small_and_empty(kind):
    t = _transport(kind)

    async def main():
        lst = await t.listen("127.0.0.1", 0, FunctionHandler(_echo))
        try:
            conn = await t.connect(lst.address)
            m = await conn.request(b"abc", b"payload")
            assert (m.header, bytes(m.payload)) == (b"cba", b"payload")
            m = await conn.request(b"xy")
            assert (m.header, len(m.payload)) == (b"yx", 0)
            with pytest.raises(RemoteError, match="KeyError"):
                await conn.request(b"boom")
            m = await conn.request(b"after", b"!")  # an error leaves the connection usable
            assert bytes(m.payload) == b"!"
            await conn.close()
        finally:
            await lst.close()

    _run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_large_payload_lands_in_place_both_ways(kind):
    t = _transport(kind)
    n = 48 << 20
    data = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)

    async def main():
        sink = _Landing(n)
        lst = await t.listen("127.0.0.1", 0, sink)
        try:
            conn = await t.connect(lst.address)
            out = np.zeros(n, dtype=np.uint8)
            m = await conn.request(b"put", data, out=memoryview(out))
            assert m.header == b"ok" and m.payload.obj is out
            assert np.array_equal(sink.buf, data) and np.array_equal(out, data)
            await conn.close()
        finally:
            await lst.close()

    _run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_requests_on_several_connections(kind):
    t = _transport(kind)

    async def main():
        lst = await t.listen("127.0.0.1", 0, FunctionHandler(_echo))
        try:
            conns = [await t.connect(lst.address) for _ in range(3)]

            async def one(i):
                body = bytes([i % 251]) * (1000 + 997 * i)
                m = await conns[i % 3].request(str(i).encode(), body)
                return m.header == str(i).encode()[::-1] and bytes(m.payload) == body

            assert all(await asyncio.gather(*(one(i) for i in range(60))))
            for c in conns:
                await c.close()
        finally:
            await lst.close()

    _run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_nobody_listening_is_a_transport_error(kind):
    from pdserve.services.kvstore.redis_proc import free_port

    t = _transport(kind)

    async def main():
        with pytest.raises(TransportError):
            conn = await t.connect(f"127.0.0.1:{free_port()}")
            await conn.request(b"x")  # ucx may connect lazily; the request must fail then

    _run(main())


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError):
        make_transport("carrier-pigeon")


def test_auto_picks_tcp_without_a_gpu(monkeypatch):
    import pdserve.connector.transport as transport
    from pdserve.connector.transport.tcp import TcpTransport

    monkeypatch.setattr(transport, "gpu_present", lambda: False)
    assert isinstance(transport.make_transport("auto"), TcpTransport)
    monkeypatch.setattr(transport, "gpu_present", lambda: True)
    ok, _ = transport.ucx_available()
    chosen = transport.make_transport("auto")
    assert isinstance(chosen, TcpTransport) != ok  # UCX when it works and a GPU is there
