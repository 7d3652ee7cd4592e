"""The bench's streaming HTTP client (bench/http_stream.py) against a scripted raw server:
chunked framing, SSE events split across reads, error events, non-200 answers, bounds."""

import asyncio
import json

import pytest

from pdserve.bench.client_http import HttpClient
from pdserve.bench.http_stream import (Endpoint, HttpStreamError, StreamLimits, request)
from pdserve.bench.record import StreamTrace
from pdserve.bench.request import BenchRequest
from pdserve.bench.target import TargetConfig

SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


def chunk(data: bytes, ext: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(data), ext, data)


def event(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def text(t: str, finish=None) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


async def read_request(reader) -> tuple[bytes, dict, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return lines[0].encode(), headers, body


async def with_server(script, run):
    """Serves one connection with script(reader, writer, seen) and awaits run(endpoint)."""
    seen = {}

    async def handle(reader, writer):
        seen["line"], seen["headers"], seen["body"] = await read_request(reader)
        try:
            await script(reader, writer, seen)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await asyncio.wait_for(run(Endpoint.parse(f"http://127.0.0.1:{port}/pre"), seen),
                                      10)
    finally:
        server.close()


def collect():
    got = []
    return got, lambda data, t: (got.append((data, t)), data != "[DONE]")[1]


def test_chunked_body_with_chunks_across_events_is_decoded():
    body = event(text("a\u2028b\x85c")) + event(text("é")) + event(b"[DONE]")
    raw = SSE_HEAD + b"".join(chunk(body[i:i + 5], b";ext=1" if i == 0 else b"")
                              for i in range(0, len(body), 5)) + b"0\r\n\r\n"

    async def script(reader, writer, seen):
        for i in range(0, len(raw), 3):  # reads that cut size lines, CRLFs and UTF-8
            writer.write(raw[i:i + 3])
            await writer.drain()

    async def run(ep, seen):
        got, sink = collect()
        resp = await request(ep, "POST", "/v1/completions", {"prompt": "x"}, sink=sink)
        return resp, got, seen

    resp, got, seen = asyncio.run(with_server(script, run))
    assert resp.status == 200
    assert [json.loads(d)["choices"][0]["text"] for d, _ in got[:2]] == ["a\u2028b\x85c", "é"]
    assert got[2][0] == "[DONE]" and len(got) == 3
    assert seen["line"] == b"POST /pre/v1/completions HTTP/1.1"
    assert json.loads(seen["body"]) == {"prompt": "x"}
    assert seen["headers"]["connection"] == "close"


def test_an_event_split_across_reads_arrives_once_at_the_time_of_its_last_part():
    first, second = event(text("a")), event(text("bc"))
    arrived = asyncio.Event()

    async def script(reader, writer, seen):
        writer.write(SSE_HEAD + chunk(first + second[:9]))
        await arrived.wait()  # the client has read the first part
        await asyncio.sleep(0.02)
        writer.write(chunk(second[9:]) + b"0\r\n\r\n")

    async def run(ep, seen):
        got = []

        def sink(data, t):
            got.append((data, t))
            arrived.set()
            return True

        await request(ep, "POST", "/v1/completions", {}, sink=sink)
        return got

    got = asyncio.run(with_server(script, run))
    assert [json.loads(d)["choices"][0]["text"] for d, _ in got] == ["a", "bc"]
    assert got[1][1] - got[0][1] >= 0.02


def bench_send(script, **target):
    """HttpClient.send of one request against the script; returns the trace."""
    async def run(ep, seen):
        client = HttpClient(TargetConfig(base_url=f"http://{ep.host}:{ep.port}",
                                         model_name="m", **target))
        await client.start()
        trace = StreamTrace(sent_t=0.0)
        await client.send(BenchRequest("r", 4, prompt_ids=(1, 2)), None, trace)
        return trace, seen

    return asyncio.run(with_server(script, run))


def test_an_error_event_mid_stream_fails_the_request():
    async def script(reader, writer, seen):
        writer.write(SSE_HEAD + chunk(event(text("a")) + event(text("b"))))
        writer.write(chunk(event({"error": {"message": "engine died"}})))
        writer.write(chunk(event(b"[DONE]")) + b"0\r\n\r\n")

    trace, seen = bench_send(script)
    assert trace.error == "engine died" and len(trace.arrivals) == 2
    body = json.loads(seen["body"])
    assert body["stream"] and body["prompt"] == [1, 2] and body["max_tokens"] == 4
    assert body["stream_options"] == {"include_usage": True}


def test_a_non_200_answer_is_a_failure_with_its_text():
    async def script(reader, writer, seen):
        msg = b'{"error": {"message": "queue full"}}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(msg), msg))

    trace, _ = bench_send(script)
    assert trace.error.startswith("HTTP 503: ") and "queue full" in trace.error
    assert not trace.arrivals


def test_a_stream_cut_before_its_last_chunk_is_a_failure():
    async def script(reader, writer, seen):
        writer.write(SSE_HEAD + chunk(event(text("a"))))

    trace, _ = bench_send(script)
    assert len(trace.arrivals) == 1 and "connection closed" in trace.error


def test_an_oversized_line_is_rejected_without_waiting_for_the_end():
    hold = asyncio.Event()

    async def script(reader, writer, seen):
        writer.write(SSE_HEAD + chunk(b"data: " + b"x" * 1000))
        await hold.wait()  # keeps the connection open: the client must not wait for it

    async def run(ep, seen):
        try:
            with pytest.raises(HttpStreamError, match="over 256 bytes"):
                await request(ep, "POST", "/v1/completions", {}, sink=lambda d, t: True,
                              limits=StreamLimits(max_line_bytes=256))
        finally:
            hold.set()

    asyncio.run(with_server(script, run))


def test_headers_over_the_limit_and_a_bad_chunk_size_are_rejected():
    async def big_head(reader, writer, seen):
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"y" * 2000 + b"\r\n\r\n")

    async def bad_size(reader, writer, seen):
        writer.write(SSE_HEAD + b"zz\r\ndata\r\n0\r\n\r\n")

    async def run(ep, seen):
        with pytest.raises(HttpStreamError):
            await request(ep, "GET", "/v1/models", limits=StreamLimits(max_header_bytes=512))

    asyncio.run(with_server(big_head, run))

    async def run_bad(ep, seen):
        with pytest.raises(HttpStreamError, match="ValueError"):
            await request(ep, "POST", "/v1/completions", {}, sink=lambda d, t: True)

    asyncio.run(with_server(bad_size, run_bad))


def test_model_lookup_reads_a_content_length_body_and_an_eof_framed_one():
    models = json.dumps({"data": [{"id": "smollm2"}]}).encode()

    async def sized(reader, writer, seen):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(models), models))

    async def until_close(reader, writer, seen):
        writer.write(b"HTTP/1.0 200 OK\r\n\r\n" + models)

    for script in (sized, until_close):
        async def run(ep, seen):
            client = HttpClient(TargetConfig(base_url=f"http://{ep.host}:{ep.port}"))
            await client.start()
            return client.model, seen["line"]

        assert asyncio.run(with_server(script, run)) == ("smollm2", b"GET /v1/models HTTP/1.1")


def test_endpoint_and_limits_validate():
    assert Endpoint.parse("https://h.example/api/") == Endpoint("h.example", 443, True, "/api")
    with pytest.raises(ValueError):
        Endpoint.parse("ftp://h")
    with pytest.raises(ValueError):
        StreamLimits(max_line_bytes=10)
