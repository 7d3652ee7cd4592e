"""Pipelined requests on one connection (Connection.pipeline): answers in order, a refused
request is its own RemoteError, a failure mid-pipeline breaks the connection and is raised,
and the base (one at a time) implementation gives the same answers."""

import asyncio

import pytest

from pdserve.connector.transport.base import Connection, FunctionHandler, RemoteError
from pdserve.connector.transport.tcp import TcpTransport


class _Serial(Connection):
    """The base class's pipeline over a TCP connection's plain requests."""

    def __init__(self, inner):
        self.inner = inner

    async def request(self, header, payload=b"", out=None):
        return await self.inner.request(header, payload, out)

    async def close(self):
        await self.inner.close()


async def _echo(header, payload):
    if header == b"refuse":
        raise ValueError("refused")
    return header + b":" + str(len(payload)).encode(), bytes(payload[:4])


def _run(coro):
    asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("serial", [False, True])
def test_answers_come_in_order_with_refusals_in_place(threads, serial):
    async def main():
        transport = TcpTransport()
        handler = FunctionHandler(_echo, max_payload=1 << 22)
        listener = await (_threaded(transport, handler) if threads
                          else transport.listen("127.0.0.1", 0, handler))
        conn = await transport.connect(listener.address)
        conn = _Serial(conn) if serial else conn
        sizes = [0, 100, 70_000, 1 << 20, 3 << 20, 5]
        payloads = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
        order, seen = [], []

        async def before(i):
            order.append(i)

        reqs = [(f"r{i}".encode(), p) for i, p in enumerate(payloads)] + [(b"refuse", b"")]
        answers = await conn.pipeline(reqs, before, lambda i, a: seen.append(i))
        assert order == seen == list(range(len(reqs)))
        for i, (a, n) in enumerate(zip(answers, sizes)):
            assert a.header == f"r{i}:{n}".encode() and bytes(a.payload) == payloads[i][:4]
        assert isinstance(answers[-1], RemoteError) and "refused" in str(answers[-1])
        again = await conn.pipeline([(b"x", b"ab")])  # a header-only refusal keeps it in step
        assert again[0].header == b"x:2"
        await conn.close()
        await listener.close()

    _run(main())


async def _threaded(transport, handler):
    class Blocking:
        def payload_buffer(self, header, nbytes):
            return handler.payload_buffer(header, nbytes)

        def serve(self, header, payload):
            if header == b"refuse":
                raise ValueError("refused")
            return header + b":" + str(len(payload)).encode(), bytes(payload[:4])

    return await transport.listen_threads("127.0.0.1", 0, Blocking())


def test_a_failing_before_send_ends_the_pipeline_and_breaks_the_connection():
    async def main():
        transport = TcpTransport()
        listener = await transport.listen("127.0.0.1", 0, FunctionHandler(_echo))
        conn = await transport.connect(listener.address)
        seen = []

        async def before(i):
            if i == 2:
                raise KeyError("mac failed")

        with pytest.raises(KeyError):
            await conn.pipeline([(b"a", b"1" * 10)] * 4, before, lambda i, a: seen.append(i))
        assert seen in ([], [0], [0, 1]) and not conn.usable
        await listener.close()

    _run(main())


def test_a_refused_payload_closes_the_connection():
    async def main():
        transport = TcpTransport()
        listener = await transport.listen("127.0.0.1", 0, FunctionHandler(_echo, max_payload=8))
        conn = await transport.connect(listener.address)
        answers = await conn.pipeline([(b"a", b"1" * 4), (b"b", b"2" * 9)])
        assert answers[0].header == b"a:4" and isinstance(answers[1], RemoteError)
        assert not conn.usable  # the server dropped the stream after the refused payload
        await listener.close()

    _run(main())


def test_a_peer_that_goes_away_raises_transport_error():
    from pdserve.connector.transport import TransportError

    async def main():
        transport = TcpTransport()
        listener = await transport.listen("127.0.0.1", 0, FunctionHandler(_echo))
        conn = await transport.connect(listener.address)
        await listener.close()
        with pytest.raises(TransportError):
            await conn.pipeline([(b"a", b"1" * 100_000)] * 8)
        assert not conn.usable

    _run(main())
