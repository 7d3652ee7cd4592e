"""A client that leaves at any moment aborts its request in the engine; the pool is whole.

The engine runs SmolLM2 on one thread, so a long request (480 tokens, ~20 s) is certainly
still running when its client leaves: with the tiny model the whole request now takes ~0.2 s,
less than a disconnect can take to travel under load, and a test could not tell a missed abort
from a race it lost."""

import json
import socket
import time

import grpc
import httpx
import pytest

from pdserve.common.rpc import engine_pb2 as epb
from pdserve.common.rpc import router_pb2 as pb
from pdserve.common.rpc import router_pb2_grpc as pb_grpc
from pdserve.tests.integration.services_helpers import (engine_load, tiny_stack,
                                                         wait_pool_whole)

pytestmark = pytest.mark.slow

MODEL = "smollm2"
ENGINE = ("--num-threads", "1", "--num-blocks", "128", "--block-size", "16",
          "--max-model-len", "512")
LONG = {"model": MODEL, "prompt": "a long story", "max_tokens": 480, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("logs"), ENGINE, model=MODEL) as s:
        yield s


def raw_post(stack, path: str, body: dict) -> socket.socket:
    host, port = stack.http_url.rsplit("/", 1)[1].split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_running(stack, n: int = 1, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine_load(stack.engine_addr).num_running < n:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.01)


@pytest.fixture
def aborts(stack):
    """After the test: the requests it lists as aborted were aborted, none of its long
    requests ran to its end, and the block pool is whole again. A missed abort shows as a
    request still running (or finished) after the 1 s the check waits."""
    before = engine_load(stack.engine_addr)
    expected = {"aborted": 0, "finished": 0}
    yield expected
    time.sleep(1.0)
    load = wait_pool_whole(stack.engine_addr)
    assert load.num_running == 0 and load.num_waiting == 0
    assert load.num_free_blocks == load.num_total_blocks
    assert load.num_finished - before.num_finished == expected["finished"]
    if expected["aborted"] is not None:
        assert load.num_aborted - before.num_aborted == expected["aborted"]


def test_streaming_client_leaves_mid_stream(stack, aborts):
    aborts["aborted"] = 1
    with httpx.stream("POST", stack.http_url + "/v1/completions", json=dict(LONG, stream=True),
                      timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(ln.startswith("data: {") for ln in got)
        load = engine_load(stack.engine_addr)
        assert load.num_running == 1 and load.num_free_blocks < load.num_total_blocks


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaves_while_engine_runs(stack, stream, aborts):
    aborts["aborted"] = 1
    sock = raw_post(stack, "/v1/completions", dict(LONG, stream=stream))
    wait_running(stack)
    sock.close()


def test_client_leaves_right_after_sending(stack, aborts):
    aborts["aborted"] = None  # cancelled before or after reaching the engine: both fine
    for path, body in (("/v1/completions", LONG),
                       ("/v1/chat/completions", {"model": MODEL, "max_tokens": 480,
                                                 "ignore_eos": True, "stream": True,
                                                 "messages": [{"role": "user", "content": "x"}]})):
        raw_post(stack, path, body).close()


def test_grpc_cancel_mid_stream(stack, aborts):
    aborts["aborted"] = 1
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        call = pb_grpc.RouterStub(channel).Generate(pb.GenerateRequest(
            text="cancel me", params=epb.SamplingParams(max_tokens=480, ignore_eos=True)))
        for _, msg in zip(range(5), call):
            assert msg.finish_reason == epb.FINISH_REASON_UNSPECIFIED
        assert engine_load(stack.engine_addr).num_running == 1
        call.cancel()


def test_other_requests_unaffected_by_cancels(stack, aborts):
    aborts.update(aborted=1, finished=1)
    sock = raw_post(stack, "/v1/completions", dict(LONG, stream=True))
    wait_running(stack)
    r = httpx.post(stack.http_url + "/v1/completions",
                   json={"model": MODEL, "prompt": "steady", "max_tokens": 20,
                         "ignore_eos": True}, timeout=30)
    sock.close()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
