"""Limits on what a client controls, each refused with a 4xx naming the parameter (never a
5xx, never an instance fault): stop strings, user, cache_salt, n, logprobs, stop_token_ids at
the router; gRPC message sizes; a message-size refusal by an engine leaves its breaker closed;
the request-head deadline closes a slowloris connection."""

import asyncio
import contextlib
import socket

import grpc
import httpx
import pytest

from pdserve.bench.router_fakes import FakeInstance
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import router_pb2, router_pb2_grpc
from pdserve.services.router.api.errors import APIError
from pdserve.services.router.api.openai_jobs import chat_job, completion_job
from pdserve.services.router.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.limits_config import MIB, LimitsConfig
from pdserve.services.router.server import start_router
from pdserve.services.router.state import RouterState
from pdserve.tests.unit.fake_engine import FakeTokenizer


class Pool:
    max_model_len = 64
    healthy = ()


def state(**kw):
    return RouterState(RouterConfig(model="fake", **kw), FakeTokenizer(), Pool(), None)


@pytest.mark.parametrize("body, param", [
    (dict(stop=["x" * 1025]), "stop"),
    (dict(stop=["a"] * 9), "stop"),
    (dict(user="u" * 257), "user"),
    (dict(cache_salt="s" * 257), "cache_salt"),
    (dict(n=9), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop_token_ids=[1] * 257), "stop_token_ids"),
    (dict(stop_token_ids=[256]), "stop_token_ids"),  # the fake tokenizer's vocabulary is 256
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(max_tokens=2 ** 32), "max_tokens"),
    (dict(min_tokens=2 ** 40, max_tokens=4), "min_tokens"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(prompt=[[1]] * 65), "prompt"),
    (dict(prompt=[1, 256]), "prompt"),
])
def test_completion_limits_name_the_parameter(body, param):
    body = {"prompt": "x", **body}
    with pytest.raises(APIError) as info:
        completion_job(CompletionRequest(**body), state(), "rid")
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_chat_limits_and_configurable_bounds():
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(APIError) as info:
        chat_job(ChatCompletionRequest(messages=msgs, logprobs=True, top_logprobs=21),
                 state(), "rid")
    assert info.value.param in ("logprobs", "top_logprobs")
    tight = state(limits=LimitsConfig(max_stop_chars=3, max_user_chars=2))
    with pytest.raises(APIError) as info:
        chat_job(ChatCompletionRequest(messages=msgs, stop=["abcd"]), tight, "rid")
    assert info.value.param == "stop"
    with pytest.raises(APIError) as info:
        chat_job(ChatCompletionRequest(messages=msgs, user="abc"), tight, "rid")
    assert info.value.param == "user"
    job = chat_job(ChatCompletionRequest(messages=msgs, stop=["abc"], user="ab"), tight, "rid")
    assert job.choices[0].params.stop == ("abc",)


@contextlib.asynccontextmanager
async def router(**kw):
    fake = await FakeInstance.start(tokens=2)
    running = None
    try:
        running = await start_router(RouterConfig(model="fake", backends=(fake.address,),
                                                  port=0, grpc_port=0, **kw),
                                     tokenizer=FakeTokenizer())
        yield running, fake
    finally:
        if running is not None:
            await running.stop()
        await fake.stop()


def test_a_5mb_stop_string_never_opens_a_breaker():
    """With the router's own limits opened wide, a 5 MB stop string reaches the instance,
    whose 4 MB gRPC limit refuses it (RESOURCE_EXHAUSTED): the client gets a 413, and the
    instance's breaker (3 failures open it) stays closed."""
    wide = LimitsConfig(max_body_bytes=16 * MIB, max_stop_chars=8 * MIB)

    async def main():
        async with router(limits=wide) as (r, fake):
            url = f"http://127.0.0.1:{r.http_port}/v1/completions"
            async with httpx.AsyncClient(timeout=30) as c:
                refused = [await c.post(url, json={"prompt": "hi", "max_tokens": 2,
                                                   "stop": ["s" * (5 * MIB)]})
                           for _ in range(4)]
                ok = await c.post(url, json={"prompt": "hi", "max_tokens": 2})
            (backend,) = r.state.pool.backends
            return refused, ok, backend.breaker.state, backend.up
    refused, ok, breaker, up = asyncio.run(asyncio.wait_for(main(), 60))
    for resp in refused:
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == "request_too_large"
    assert breaker == "closed" and up
    assert ok.status_code == 200


def test_router_limits_hold_at_defaults():
    """At the defaults the router itself refuses a 5 MB body (413) and a 2 KB stop string (400)
    before any instance sees them; its gRPC API refuses a message over 4 MB."""
    async def main():
        async with router() as (r, fake):
            url = f"http://127.0.0.1:{r.http_port}/v1/completions"
            async with httpx.AsyncClient(timeout=30) as c:
                big = await c.post(url, json={"prompt": "hi", "stop": ["s" * (5 * MIB)]})
                long_stop = await c.post(url, json={"prompt": "hi", "stop": ["s" * 2048]})
            req = router_pb2.GenerateRequest(text="hi", params=pb.SamplingParams(
                max_tokens=2, stop=["s" * (5 * MIB)]))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") as ch:
                try:
                    [m async for m in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=20)]
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as err:
                    code = err.code()
            return big, long_stop, code, fake.calls
    big, long_stop, code, calls = asyncio.run(asyncio.wait_for(main(), 60))
    assert big.status_code == 413 and long_stop.status_code == 400
    assert long_stop.json()["error"]["param"] == "stop"
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert calls == 0


def test_a_client_that_trickles_its_headers_is_cut_off():
    async def main():
        async with router(limits=LimitsConfig(http_header_timeout_s=0.3)) as (r, _):
            loop = asyncio.get_running_loop()

            def slowloris() -> bytes:
                with socket.create_connection(("127.0.0.1", r.http_port), timeout=20) as s:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                    return s.recv(1024)  # b"" once the server closes; a timeout fails
            return await loop.run_in_executor(None, slowloris)
    assert asyncio.run(asyncio.wait_for(main(), 60)) == b""


def test_limit_flags_reach_the_config():
    import argparse

    from pdserve.services import cli_serve
    from pdserve.services.router.cli_args import router_config

    p = argparse.ArgumentParser()
    cli_serve.add_subcommands(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["serve", "router", "--model", "tiny", "--backends", "127.0.0.1:1",
                         "--max-body-bytes", "1000", "--request-timeout", "5",
                         "--http-header-timeout", "2", "--grpc-max-message-bytes", "99",
                         "--max-priority", "3", "--tenant-secret-file", "/s"])
    cfg = router_config(args, cli_serve._addresses)
    assert (cfg.limits.max_body_bytes, cfg.limits.request_timeout_s,
            cfg.limits.http_header_timeout_s, cfg.limits.grpc_max_message_bytes) == (1000, 5, 2,
                                                                                     99)
    assert cfg.admission.max_priority == 3 and cfg.tenant_secret_file == "/s"
    defaults = router_config(p.parse_args(["serve", "router", "--model", "tiny", "--backends",
                                           "127.0.0.1:1"]), cli_serve._addresses)
    assert defaults.limits == LimitsConfig()


def test_one_token_id_prompt_is_one_prompt_whatever_its_length():
    """A list of ints is one prompt (bounded later by the model length); only a batch of
    prompts is capped at MAX_PROMPTS."""
    from pdserve.services.router.api.errors import APIError
    from pdserve.services.router.api.prompts import MAX_PROMPTS, completion_prompts

    ids = list(range(1, 3 * MAX_PROMPTS))
    assert completion_prompts(ids, tokenizer=None) == [ids]
    with pytest.raises(APIError, match="at most"):
        completion_prompts([[1, 2]] * (MAX_PROMPTS + 1), tokenizer=None)
