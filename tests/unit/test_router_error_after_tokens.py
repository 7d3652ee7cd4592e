"""The ladder's last rung: a decode instance that fails after tokens were streamed is not
retried (the client already has tokens; a second instance would repeat or diverge); the client
gets a clean error after its tokens, the rung's counter moves, the lease is returned, and the
router goes on serving."""

import asyncio
import json

import httpx

from pdserve.bench.router_fakes import FakeInstance
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.server import start_router
from pdserve.tests.unit.fake_engine import FakeTokenizer


def _events(text: str) -> list:
    return [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]


def test_failure_after_tokens_is_a_clean_error_and_not_retried():
    async def main():
        fakes = [await FakeInstance.start(tokens=5) for _ in range(2)]
        for f in fakes:
            f.fail_after(2)
        running = await start_router(RouterConfig(
            model="fake", backends=tuple(f.address for f in fakes), port=0, grpc_port=0),
            tokenizer=FakeTokenizer())
        url = f"http://127.0.0.1:{running.http_port}"
        try:
            async with httpx.AsyncClient(timeout=20) as c:
                streamed = await c.post(f"{url}/v1/completions", json={
                    "prompt": "hi", "max_tokens": 5, "stream": True})
                assert streamed.status_code == 200  # headers went out with the first token
                events = _events(streamed.text)
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                assert sum(1 for ch in chunks if "choices" in ch) == 2  # the two tokens
                assert chunks[-1]["error"]["message"] and "error" not in chunks[0]
                assert sum(f.calls for f in fakes) == 1  # no second instance tried

                whole = await c.post(f"{url}/v1/completions", json={"prompt": "hi",
                                                                    "max_tokens": 5})
                assert whole.status_code >= 500 and whole.json()["error"]["message"]
                assert sum(f.calls for f in fakes) == 2

                for f in fakes:
                    f.fail_after(None)
                ok = await c.post(f"{url}/v1/completions", json={"prompt": "hi",
                                                                 "max_tokens": 5})
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
                metrics = (await c.get(f"{url}/metrics")).text
            assert 'pdserve_router_fallback_rungs_total{rung="error_after_tokens"} 2.0' in metrics
            assert 'pdserve_router_fallback_rungs_total{rung="decode_retry"} 0.0' in metrics
            for backend in running.state.pool.backends:  # every lease came back
                assert backend.inflight == 0 and backend.inflight_tokens == 0
        finally:
            await running.stop()
            for f in fakes:
                await f.stop()
    asyncio.run(asyncio.wait_for(main(), 60))
