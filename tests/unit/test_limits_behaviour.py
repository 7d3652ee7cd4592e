"""Issue 13's limits as behaviour, not just configuration: an idle keep-alive connection is
closed; an oversized request head is refused; the (N+1)th concurrent gRPC call gets
RESOURCE_EXHAUSTED; the store client's connect to a node that never accepts ends at its
connect timeout; a client's request id (HTTP header or gRPC field) is only echoed, the engine
sees the router's own."""

import asyncio
import contextlib
import json
import socket
import time

import grpc
import httpx
import pytest

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import router_pb2, router_pb2_grpc
from pdserve.connector.kvstore.conn_pool import ConnectionPool
from pdserve.connector.transport import TransportError, make_transport
from pdserve.services.router.limits_config import LimitsConfig
from pdserve.tests.unit.test_router_limits import router


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _exchange(port: int, head: bytes) -> bytes:
    """Every byte the server sends until it closes the connection; a server that keeps it
    open fails the test at the 20 s socket timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(head)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def test_an_idle_keep_alive_connection_is_closed():
    """One request on a kept-alive connection, then silence: the server closes it (the
    request-head deadline is set far past the socket timeout, so only the keep-alive limit
    can be what closed it)."""
    limits = LimitsConfig(http_keep_alive_s=0.3, http_header_timeout_s=120)

    async def main():
        async with router(limits=limits) as (r, _):
            return await asyncio.get_running_loop().run_in_executor(None, _exchange,
                r.http_port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    got = _run(main())
    assert got.startswith(b"HTTP/1.1 200") and got.count(b"HTTP/1.1 ") == 1
    assert b"connection: close" not in got.lower()  # kept alive, then closed when idle


def test_an_oversized_request_head_is_refused_and_the_router_serves_on():
    async def main():
        async with router(limits=LimitsConfig(http_max_header_bytes=4096)) as (r, _):
            loop = asyncio.get_running_loop()
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 16384 +
                    b"\r\nContent-Length: 2\r\n\r\n{}")
            refused = await loop.run_in_executor(None, _exchange, r.http_port, head)
            async with httpx.AsyncClient(timeout=30) as c:
                ok = await c.post(f"http://127.0.0.1:{r.http_port}/v1/completions",
                                  json={"prompt": "hi", "max_tokens": 2})
            return refused, ok
    refused, ok = _run(main())
    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), refused[:200]
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert ok.status_code == 200


def test_the_n_plus_first_concurrent_grpc_call_is_refused():
    """Two Generate calls held open at an instance that waits before its first token fill a
    limit of two; the third gets RESOURCE_EXHAUSTED at once; after the two end, calls pass."""
    async def main():
        async with router(limits=LimitsConfig(grpc_max_concurrent_rpcs=2)) as (r, fake):
            fake._state.delay_s = 30.0  # the held calls wait there until cancelled
            req = router_pb2.GenerateRequest(text="hi", params=pb.SamplingParams(max_tokens=2))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                held = [stub.Generate(req, timeout=50) for _ in range(2)]
                readers = [asyncio.ensure_future(h.read()) for h in held]
                while fake.calls < 2:  # both reached the instance: both are in flight
                    await asyncio.sleep(0.05)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in stub.Generate(req, timeout=20)]
                for h in held:
                    h.cancel()
                await asyncio.gather(*readers, return_exceptions=True)
                fake._state.delay_s = 0.0
                after = await _once_slots_free(stub, req)
            return err.value.code(), after
    code, after = _run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [t for m in after for t in m.token_ids]


async def _once_slots_free(stub, req, deadline_s: float = 20.0):
    """The call's messages once the server has released the cancelled calls' slots (it does
    so shortly after the cancellations, not at once)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return [m async for m in stub.Generate(req, timeout=20)]
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > end:
                raise
            await asyncio.sleep(0.05)


@contextlib.contextmanager
def never_accepting():
    """host:port of a listening socket whose accept queue is full: a connect's SYN is dropped
    and the connect hangs, as to a blackholed address (an unroutable one is not reliably
    blackholed in every sandbox)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    held = []
    try:
        for _ in range(16):  # fill the queue until a connect hangs
            s = socket.socket()
            s.settimeout(0.5)
            held.append(s)
            try:
                s.connect(srv.getsockname())
            except (TimeoutError, socket.timeout):
                break
        else:
            raise AssertionError("the accept queue never filled")
        yield "127.0.0.1:%d" % srv.getsockname()[1]
    finally:
        for s in held:
            s.close()
        srv.close()


def test_a_connect_to_a_node_that_never_accepts_ends_at_the_connect_timeout():
    async def main():
        pool = ConnectionPool(make_transport("tcp"), connect_timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="timed out"):
            async with pool.connection(addr):
                pass
        return time.monotonic() - t0
    with never_accepting() as addr:
        took = _run(main())
    assert took < 15  # 0.5 s asked; the kernel's own connect would retry for ~2 min


def test_a_clients_request_id_is_only_echoed():
    async def main():
        async with router() as (r, fake):
            async with httpx.AsyncClient(timeout=30) as c:
                resp = await c.post(f"http://127.0.0.1:{r.http_port}/v1/completions",
                                    json={"prompt": "hi", "max_tokens": 2},
                                    headers={"x-request-id": "victim-id"})
            req = router_pb2.GenerateRequest(request_id="victim-id", text="hi",
                                             params=pb.SamplingParams(max_tokens=2))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch:
                msgs = [m async for m in router_pb2_grpc.RouterStub(ch).Generate(
                    req, timeout=20)]
            return resp, msgs, fake.request_ids
    resp, msgs, seen = _run(main())
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "victim-id"
    assert {m.request_id for m in msgs} == {"victim-id"}
    assert len(seen) == 2 and len(set(seen)) == 2
    assert all("victim-id" not in rid for rid in seen)
