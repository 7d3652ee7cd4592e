"""A client leaving mid-stream is an INFO line, not an ERROR traceback: no `Failed to detach
context` from OpenTelemetry on the engine or the router (spans opened inside streaming
servicers close in the context that opened them), whichever API the client left."""

import gc
import logging
import time

import grpc
import httpx
import pytest

from pdserve.common.rpc import engine_pb2 as epb
from pdserve.common.rpc import router_pb2 as pb
from pdserve.common.rpc import router_pb2_grpc as pb_grpc
from pdserve.tests.integration.inproc_stack import inproc_stack
from pdserve.tests.integration.services_helpers import engine_load

LONG = epb.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack():
    with inproc_stack() as s:
        yield s


def wait_idle(address: str) -> None:
    deadline = time.monotonic() + 15
    while engine_load(address).num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_load(address).num_running == 0


def leave_engine_decode(stack):
    with grpc.insecure_channel(stack.engine_addr) as channel:
        call = epb_stub(channel).Decode(epb.DecodeRequest(
            request_id="leaver-engine", prompt_token_ids=list(range(1, 20)), params=LONG),
            timeout=30)
        next(call), next(call)
        call.cancel()


def epb_stub(channel):
    from pdserve.common.rpc import engine_pb2_grpc

    return engine_pb2_grpc.DecodeServiceStub(channel)


def leave_router_grpc(stack):
    with grpc.insecure_channel(stack.router_grpc) as channel:
        call = pb_grpc.RouterStub(channel).Generate(
            pb.GenerateRequest(text="leave me", params=LONG), timeout=30)
        next(call), next(call)
        call.cancel()


def leave_router_http(stack):
    body = {"model": "tiny", "prompt": "leave me", "max_tokens": 200, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{stack.router_http}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
    # leaving the block closes the connection mid-stream


@pytest.mark.parametrize("leave", [leave_engine_decode, leave_router_grpc, leave_router_http])
def test_client_disconnect_logs_info_not_error(stack, caplog, leave):
    caplog.set_level(logging.INFO)
    leave(stack)
    wait_idle(stack.engine_addr)
    # A servicer generator left suspended at a `yield` is closed by asyncio's finalizer hook
    # in a new task when collected; collect now so that close happens inside the test.
    gc.collect()
    time.sleep(0.3)
    detach = [r for r in caplog.records if "Failed to detach context" in r.getMessage()]
    assert not detach, detach[0].getMessage()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    left = [r for r in caplog.records
            if r.levelno == logging.INFO and "the caller left" in r.getMessage()]
    assert left, [r.getMessage() for r in caplog.records]
