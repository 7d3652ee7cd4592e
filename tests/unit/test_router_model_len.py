"""One instance's max_model_len does not shrink the fleet: a prompt is refused (400,
context_length_exceeded) only when no healthy instance can take it, and an instance too small
for a prompt is never picked for it. (The pool used the minimum over instances, so one
instance, or anything that passed as one, reporting max_model_len=1 refused every prompt.)"""

import asyncio

import httpx
import pytest

from pdserve.bench.router_fakes import FakeInstance
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.server import start_router
from pdserve.tests.unit.fake_engine import FakeTokenizer


async def _fleet(prompts: list[str]):
    tiny = await FakeInstance.start(tokens=2, max_model_len=1)
    big = await FakeInstance.start(tokens=2, max_model_len=64)
    running = None
    try:
        running = await start_router(RouterConfig(model="fake", port=0, grpc_port=0,
                                                  backends=(tiny.address, big.address)),
                                     tokenizer=FakeTokenizer())
        assert len(running.state.pool.healthy) == 2  # both passed their first check
        base = f"http://127.0.0.1:{running.http_port}/v1"
        async with httpx.AsyncClient(timeout=30) as c:
            answers = [await c.post(f"{base}/completions",
                                    json={"prompt": p, "max_tokens": 2}) for p in prompts]
            models = (await c.get(f"{base}/models")).json()
        return answers, models, tiny.calls, big.calls
    finally:
        if running is not None:
            await running.stop()
        await tiny.stop()
        await big.stop()


def test_a_tiny_instance_neither_refuses_prompts_nor_gets_them():
    # the fake tokenizer is byte-level: a prompt of n ASCII characters is n tokens
    served = ["x" * 20, "y" * 30, "z", "w" * 63]
    refused = ["v" * 64, "u" * 200]
    answers, models, tiny_calls, big_calls = asyncio.run(
        asyncio.wait_for(_fleet(served + refused), 60))
    for resp in answers[:len(served)]:
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
    for resp in answers[len(served):]:
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded" and "64 tokens" in err["message"]
    assert tiny_calls == 0 and big_calls == len(served)
    assert models["data"][0]["max_model_len"] == 64


def test_with_no_instance_up_a_prompt_gets_503_not_a_length_error():
    from pdserve.common.telemetry.metrics import RouterMetrics
    from pdserve.services.router.api.errors import APIError
    from pdserve.services.router.routing.backends import BackendPool
    from pdserve.services.router.routing.candidate import RouteRequest

    async def main():
        pool = BackendPool(("127.0.0.1:1",), RouterMetrics(), 1.0, 1.0, 1)
        try:
            with pytest.raises(APIError) as info:
                pool.choose(RouteRequest(prompt_len=10))
            return info.value
        finally:
            await pool.close()
    err = asyncio.run(main())
    assert err.status == 503 and err.code == "no_backend"
