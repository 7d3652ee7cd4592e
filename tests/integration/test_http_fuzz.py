"""HTTP fuzz (hypothesis, derandomized so every run is the same): request bodies and headers
built from valid values, wrong types, extremes, NaN/inf, lone surrogates and garbage go to a
real router over a live tiny engine (both in this process). Properties: never a 5xx, every
error is OpenAI-shaped JSON, every stream ends with [DONE], and afterwards the engine is
SERVING with every block free and no failed step."""

import asyncio
import json
import math
import threading
import time

import grpc
import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.services.engine_host.engine_server import start_engine_server
from pdserve.services.launcher import http_ok
from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.limits_config import LimitsConfig
from pdserve.services.router.server import start_router

EXAMPLES = 200

weird_numbers = st.sampled_from([0, -1, 1, 2, 319, 320, 2 ** 31, 2 ** 32, 2 ** 63, 10 ** 30,
                                 -10 ** 30, 0.5, -0.0, 1e-30, 1e308, math.nan, math.inf,
                                 -math.inf])
weird_text = st.one_of(st.text(max_size=20), st.sampled_from(["\ud800", "a\udfffb", "",
                                                              "x" * 2000, "\x00", "日本"]))
anything = st.recursive(st.one_of(st.none(), st.booleans(), weird_numbers, weird_text),
                        lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                        max_leaves=8)
token_ids = st.lists(st.one_of(st.integers(0, 319), weird_numbers), min_size=0, max_size=6)
prompt = st.one_of(weird_text, token_ids, st.lists(weird_text, max_size=3),
                   st.lists(token_ids, max_size=3), anything)
content = st.one_of(weird_text, st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "x"]), "text": weird_text}), max_size=2),
    anything)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                          "tool", ""]),
                                 "content": content},
                                optional={"name": weird_text, "tool_calls": anything,
                                          "extra": anything})
number_or_any = st.one_of(weird_numbers, anything)
SAMPLING = {
    "max_tokens": st.one_of(st.integers(1, 8), weird_numbers, anything),
    "temperature": number_or_any, "top_p": number_or_any, "top_k": number_or_any,
    "min_p": number_or_any, "seed": number_or_any, "n": st.one_of(st.integers(1, 3),
                                                                  number_or_any),
    "stop": st.one_of(weird_text, st.lists(weird_text, max_size=10), anything),
    "stop_token_ids": st.one_of(token_ids, anything), "min_tokens": number_or_any,
    "presence_penalty": number_or_any, "frequency_penalty": number_or_any,
    "repetition_penalty": number_or_any, "logprobs": number_or_any,
    "stream": st.booleans(), "stream_options": anything, "user": weird_text,
    "cache_salt": weird_text, "logit_bias": anything, "ignore_eos": anything,
    "response_format": anything, "best_of": number_or_any, "echo": anything,
    "top_logprobs": number_or_any, "unknown_field": anything,
}
completion_body = st.fixed_dictionaries({"prompt": prompt}, optional=SAMPLING)
chat_body = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=3),
                                                         anything)}, optional=SAMPLING)
headers = st.fixed_dictionaries({}, optional={
    "x-priority": st.sampled_from(["1", "-5", "1000", "99999", "x", ""]),
    "x-ttft-slo-ms": st.sampled_from(["0", "-1", "nan", "inf", "1e308", "abc", "50"]),
    "authorization": st.sampled_from(["Bearer k", "Basic x", "bearer  y", "Bearer"])})

VALID = {  # in range: these requests should mostly be served
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2 ** 62), "n": st.integers(1, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "stream": st.booleans(),
    "user": st.text(max_size=10), "cache_salt": st.text(max_size=10),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 1),
}
valid_completion = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(min_size=1, max_size=30),
                         st.lists(st.integers(0, 319), min_size=1, max_size=20)),
     "max_tokens": st.integers(1, 8)}, optional=VALID)
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                 "content": st.text(max_size=30)}),
                          min_size=1, max_size=2),
     "max_tokens": st.integers(1, 8)}, optional=VALID)
request = st.one_of(
    st.tuples(st.just("/v1/completions"), valid_completion.map(json.dumps), headers),
    st.tuples(st.just("/v1/chat/completions"), valid_chat.map(json.dumps), headers),
    st.tuples(st.just("/v1/completions"), completion_body.map(json.dumps), headers),
    st.tuples(st.just("/v1/chat/completions"), chat_body.map(json.dumps), headers),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
              st.binary(max_size=64), headers),
)


@pytest.fixture(scope="module")
def stack():
    """A tiny engine and a router on one event loop, on a thread of their own."""
    torch.set_num_threads(1)
    from pdserve.common.engine.engine_core import EngineCore
    from pdserve.services.router.api.tokenizer_loader import load_tokenizer

    ecfg = EngineServiceConfig(role="unified", port=0, model="tiny", num_blocks=64,
                               max_model_len=64, block_size=16)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    engine = on_loop(start_engine_server(ecfg, EngineCore(ecfg.engine_config())))
    assert on_loop(engine.engine.wait_warmed_up(), 120)  # SERVING only after its warm-up
    address = f"127.0.0.1:{engine.port}"
    router = on_loop(start_router(RouterConfig(
        model="tiny", backends=(address,), port=0, grpc_port=-1, max_n=4,
        limits=LimitsConfig(request_timeout_s=30)), tokenizer=load_tokenizer("tiny")))
    # a request before the router's first health poll saw the engine is a correct 503 ("try
    # again shortly"), not what this test fuzzes: start once the router has seen it SERVING
    deadline = time.monotonic() + 60
    while not http_ok(f"http://127.0.0.1:{router.http_port}/health"):
        assert time.monotonic() < deadline, "the router never saw the engine SERVING"
        time.sleep(0.1)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{router.http_port}", timeout=30) as c:
            yield c, address
    finally:
        on_loop(router.stop())
        on_loop(engine.stop(1.0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_no_request_gets_a_5xx_or_hurts_the_engine(stack):
    client, address = stack
    seen = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request)
    def one(req):
        path, body, hdrs = req
        r = client.post(path, content=body, headers={"content-type": "application/json",
                                                     **hdrs})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.status_code, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
            assert '"error"' not in r.text, r.text[-300:]
        else:
            assert r.json()["choices"]

    one()
    assert seen.get(200, 0) >= 20 and sum(v for k, v in seen.items() if k >= 400) >= 50, seen

    async def engine_state():
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.DecodeServiceStub(ch)
            for _ in range(200):  # stats are published just after a step's outputs
                load = await stub.GetLoad(pb.LoadRequest())
                if load.num_running == 0 and load.num_waiting == 0:
                    break
                await asyncio.sleep(0.025)
            return await stub.Health(pb.HealthRequest()), load
    health, load = asyncio.run(engine_state())
    assert health.status == pb.HealthResponse.SERVING
    assert load.num_step_failures == 0 and load.num_running == 0 and load.num_waiting == 0
    assert load.num_free_blocks == load.num_total_blocks
    metrics = client.get("/metrics").text
    assert 'status="5' not in metrics
