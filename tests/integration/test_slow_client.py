"""64 concurrent streaming clients, one of which reads nothing: the other 63 still finish with
normal inter-token latency, because nothing between the engine and a client waits on another."""

import asyncio
import json
import socket
import statistics
import time

import httpx
import pytest

from pdserve.tests.integration.services_helpers import tiny_stack, wait_pool_whole

TOKENS = 48


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("logs")) as s:
        yield s


def stuck_reader(stack) -> socket.socket:
    """Sends a long streaming request with a tiny receive buffer and never reads."""
    host, port = stack.http_url.rsplit("/", 1)[1].split(":")
    body = json.dumps({"model": "tiny", "prompt": "never read", "max_tokens": 480,
                       "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


async def one_client(client: httpx.AsyncClient, i: int) -> tuple[list[float], dict]:
    body = {"model": "tiny", "prompt": f"client {i}", "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    stamps, last = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    stamps.append(time.monotonic())
                else:
                    last = chunk
    return stamps, last


async def many_clients(stack, n: int):
    limits = httpx.Limits(max_connections=n + 1)
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60, limits=limits) as client:
        return await asyncio.gather(*(one_client(client, i) for i in range(n)))


def gaps(results) -> list[float]:
    return [b - a for stamps, _ in results for a, b in zip(stamps, stamps[1:])]


def test_one_stuck_reader_does_not_slow_the_others(stack):
    baseline = statistics.median(gaps(asyncio.run(many_clients(stack, 63))))
    sock = stuck_reader(stack)
    try:
        t0 = time.monotonic()
        results = asyncio.run(many_clients(stack, 63))
        elapsed = time.monotonic() - t0
        assert all(usage["usage"]["completion_tokens"] == TOKENS for _, usage in results)
        g = sorted(gaps(results))
        median, p99 = statistics.median(g), g[int(0.99 * (len(g) - 1))]
        # Same load plus one idle socket: latency stays in the baseline's range (generous
        # bounds, the machine is shared).
        print(f"ITL median {median:.4f}s (baseline {baseline:.4f}s), p99 {p99:.4f}s")
        assert median < max(5 * baseline, 0.05), (median, baseline)
        assert p99 < 2.0, p99
        assert elapsed < 60
    finally:
        sock.close()
    load = wait_pool_whole(stack.engine_addr)
    assert load.num_free_blocks == load.num_total_blocks and load.num_running == 0
