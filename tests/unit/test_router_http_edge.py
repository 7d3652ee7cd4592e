"""The router's HTTP edge through a real router over instant fake instances (in process):
inputs that used to give a plain-text 500 are OpenAI-shaped 400s; FastAPI's own 404 / 405 and
an unexpected exception are OpenAI-shaped JSON; every response is counted by status; the body
size limit (413) and the per-request deadline (504) hold."""

import asyncio
import contextlib
import re

import httpx
import pytest

from pdserve.bench.router_fakes import FakeInstance
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.limits_config import LimitsConfig
from pdserve.services.router.server import start_router
from pdserve.tests.unit.fake_engine import FakeTokenizer


@contextlib.asynccontextmanager
async def router(fake_delay_s: float = 0.0, tokenizer=None, **kw):
    fake = await FakeInstance.start(tokens=2, delay_s=fake_delay_s)
    running = None
    try:
        running = await start_router(RouterConfig(model="fake", backends=(fake.address,),
                                                  port=0, grpc_port=-1, **kw),
                                     tokenizer=tokenizer or FakeTokenizer())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.http_port}",
                                     timeout=20) as client:
            yield client
    finally:
        if running is not None:
            await running.stop()
        await fake.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def counted(metrics: str, endpoint: str, status: int) -> float:
    m = re.search(rf'pdserve_requests_total\{{endpoint="{re.escape(endpoint)}",'
                  rf'status="{status}"\}} (\S+)', metrics)
    return float(m.group(1)) if m else 0.0


JSON = {"Content-Type": "application/json"}


def test_former_plain_text_500s_are_openai_400s_and_counted():
    async def main():
        async with router() as c:
            r1 = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10 ** 30})
            r2 = await c.post("/v1/chat/completions", headers=JSON, content=(
                b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'))
            r3 = await c.post("/v1/completions", json={"prompt": [-5]})
            r4 = await c.post("/v1/completions", json={"prompt": [10 ** 6]})
            r5 = await c.post("/v1/completions", headers=JSON,
                              content=b'{"prompt": "x", "temperature": NaN}')
            r6 = await c.post("/v1/completions", headers=JSON,
                              content=b'{"prompt": "x", "top_p": Infinity}')
            r7 = await c.post("/v1/completions", headers=JSON,
                              content=b"[" * 100_000 + b"]" * 100_000)
            metrics = (await c.get("/metrics")).text
            return (r1, r2, r3, r4, r5, r6, r7), metrics
    (r1, r2, r3, r4, r5, r6, r7), metrics = run(main())
    assert_openai_error(r1, 400, "max_tokens")
    assert "surrogate" in assert_openai_error(r2, 400)["message"]
    assert_openai_error(r3, 400, "prompt")
    assert_openai_error(r4, 400, "prompt")
    assert_openai_error(r5, 400, "temperature")
    assert_openai_error(r6, 400, "top_p")
    assert_openai_error(r7, 400)
    assert counted(metrics, "/v1/completions", 400) == 6
    assert counted(metrics, "/v1/chat/completions", 400) == 1


def test_framework_errors_and_crashes_are_openai_shaped_and_counted():
    class Exploding(FakeTokenizer):
        def encode(self, text):
            if text == "boom":
                raise RuntimeError("tokenizer bug")
            return super().encode(text)

    async def main():
        async with router(tokenizer=Exploding()) as c:
            missing = await c.get("/v1/nothing")
            wrong_method = await c.get("/v1/completions")
            crashed = await c.post("/v1/completions", json={"prompt": "boom"})
            ok = await c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
            models = await c.get("/v1/models")
            metrics = (await c.get("/metrics")).text
            return missing, wrong_method, crashed, ok, models, metrics
    missing, wrong_method, crashed, ok, models, metrics = run(main())
    assert assert_openai_error(missing, 404)["code"] == "not_found"
    assert assert_openai_error(wrong_method, 405)["code"] == "method_not_allowed"
    assert "tokenizer bug" not in assert_openai_error(crashed, 500)["message"]
    assert ok.status_code == 200 and models.status_code == 200
    assert counted(metrics, "other", 404) == 1
    assert counted(metrics, "/v1/completions", 405) == 1
    assert counted(metrics, "/v1/completions", 500) == 1
    assert counted(metrics, "/v1/completions", 200) == 1
    assert counted(metrics, "/v1/models", 200) == 1


def test_body_size_limit():
    async def main():
        async with router(limits=LimitsConfig(max_body_bytes=1000)) as c:
            small = await c.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1})
            big = await c.post("/v1/completions", json={"prompt": "x" * 2000})

            async def chunks():  # no Content-Length: the limit counts what arrives
                for _ in range(20):
                    yield b" " * 100

            chunked = await c.post("/v1/completions", headers=JSON, content=chunks())
            metrics = (await c.get("/metrics")).text
            return small, big, chunked, metrics
    small, big, chunked, metrics = run(main())
    assert small.status_code == 200
    assert assert_openai_error(big, 413)["code"] == "request_too_large"
    assert assert_openai_error(chunked, 413)["code"] == "request_too_large"
    assert counted(metrics, "/v1/completions", 413) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_request_deadline(stream):
    async def main():
        async with router(fake_delay_s=2.0,
                          limits=LimitsConfig(request_timeout_s=0.3)) as c:
            return await c.post("/v1/completions", json={"prompt": "slow", "stream": stream,
                                                         "max_tokens": 2})
    r = run(main())
    # the fake holds the first token back for 2 s; the router waits for it before answering
    assert assert_openai_error(r, 504)["code"] == "deadline_exceeded"


def test_concurrency_limit_is_an_openai_503():
    async def main():
        fake = await FakeInstance.start(tokens=2, delay_s=2.0)
        running = await start_router(RouterConfig(
            model="fake", backends=(fake.address,), port=0, grpc_port=-1,
            limits=LimitsConfig(http_max_concurrency=1)), tokenizer=FakeTokenizer())
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.http_port}",
                                         timeout=20) as c:
                slow = asyncio.ensure_future(c.post("/v1/completions",
                                                    json={"prompt": "slow", "max_tokens": 2}))
                while fake.calls == 0:  # the slow one holds the only slot until its token
                    await asyncio.sleep(0.01)
                refused = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                return await slow, refused, (await c.get("/metrics")).text
        finally:
            await running.stop()
            await fake.stop()
    slow, refused, metrics = run(main())
    assert slow.status_code == 200
    assert assert_openai_error(refused, 503)["code"] == "too_many_connections"
    assert refused.headers["retry-after"] == "1"
    assert counted(metrics, "/v1/completions", 503) == 1
