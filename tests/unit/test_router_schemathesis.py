"""schemathesis against the router's own OpenAPI schema (/openapi.json, whose request bodies
are the models in openai_protocol.py): bodies that follow the schema, and bodies that break it,
for every route, through a real router over an instant fake instance. The property: never a
5xx, and every error is OpenAI-shaped JSON. Derandomized, so every run is the same."""

import asyncio
import threading

import httpx
import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")

from pdserve.bench.router_fakes import FakeInstance  # noqa: E402
from pdserve.services.router.config import RouterConfig  # noqa: E402
from pdserve.services.router.server import start_router  # noqa: E402
from pdserve.tests.unit.fake_engine import FakeTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def router_url():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    fake = on_loop(FakeInstance.start(tokens=2))
    running = on_loop(start_router(RouterConfig(model="fake", backends=(fake.address,),
                                                port=0, grpc_port=-1),
                                   tokenizer=FakeTokenizer()))
    try:
        yield f"http://127.0.0.1:{running.http_port}"
    finally:
        on_loop(running.stop())
        on_loop(fake.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_router_openapi(router_url):
    from hypothesis import given

    api = schemathesis.openapi.from_url(f"{router_url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    seen = {}
    with httpx.Client(base_url=router_url, timeout=20) as client:
        for op in operations:
            # a GET without parameters has no way to break its schema
            modes = ("positive", "negative") if op.method.upper() == "POST" else ("positive",)
            for mode in modes:
                strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

                @given(strategy)
                @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))
                def one(case):
                    kw = case.as_transport_kwargs(base_url=router_url)
                    r = client.request(kw["method"], kw["url"], headers=kw.get("headers"),
                                       params=kw.get("params"), json=kw.get("json"),
                                       content=kw.get("content", kw.get("data")))
                    seen[r.status_code] = seen.get(r.status_code, 0) + 1
                    assert r.status_code < 500, (case.method, case.path, case.body, r.text)
                    if r.status_code >= 400:
                        err = r.json()["error"]
                        assert set(err) == {"message", "type", "param", "code"}
                        assert err["message"]
                one()
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if k >= 400) > 0, seen
