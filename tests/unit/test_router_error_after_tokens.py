"""The ladder's last rungs. A decode instance that fails after tokens were streamed: the
request migrates (prompt + tokens delivered go to another instance, which continues after
them), so the client's stream goes on with no error and nothing repeated or missing, up to
`max_migrations`. With migration off (or past the limit) the client gets a clean error after
its tokens, the rung's counter moves, the lease is returned, and the router goes on serving."""

import asyncio
import json

import httpx

from pdserve.bench.router_fakes import FakeInstance
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch.fallback_config import FallbackConfig
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
            model="fake", backends=tuple(f.address for f in fakes), port=0, grpc_port=0,
            fallback=FallbackConfig(max_migrations=0)), tokenizer=FakeTokenizer())
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


def _router(fakes, max_migrations: int):
    return start_router(RouterConfig(
        model="fake", backends=tuple(f.address for f in fakes), port=0, grpc_port=0,
        fallback=FallbackConfig(max_migrations=max_migrations, backoff_s=0.0)),
        tokenizer=FakeTokenizer())


def test_a_stream_migrates_and_continues_without_error_or_repeats():
    """Each instance dies after 2 tokens of any stream: 6 tokens need two migrations (A, B,
    C); the client sees the uninterrupted tokens once each and no error."""
    async def main():
        fakes = [await FakeInstance.start(tokens=6) for _ in range(3)]
        for f in fakes:
            f.fail_after(2)
        running = await _router(fakes, 3)
        url = f"http://127.0.0.1:{running.http_port}"
        try:
            async with httpx.AsyncClient(timeout=20) as c:
                streamed = await c.post(f"{url}/v1/completions", json={
                    "prompt": [7, 9], "max_tokens": 6, "stream": True})
                chunks = [json.loads(e) for e in _events(streamed.text)[:-1]]
                assert all("error" not in ch for ch in chunks), chunks
                text = "".join(ch["choices"][0]["text"] for ch in chunks if ch.get("choices"))
                assert text == "xxxxxx"
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                assert sorted(f.calls for f in fakes) == [1, 1, 1]
                metrics = (await c.get(f"{url}/metrics")).text
            assert 'pdserve_router_migrations_total{outcome="ok"} 2.0' in metrics
            assert 'pdserve_router_fallback_rungs_total{rung="error_after_tokens"} 0.0' in metrics
            for backend in running.state.pool.backends:
                assert backend.inflight == 0 and backend.inflight_tokens == 0
        finally:
            await running.stop()
            for f in fakes:
                await f.stop()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_migration_stops_at_the_limit_with_a_clean_error():
    async def main():
        fakes = [await FakeInstance.start(tokens=9) for _ in range(2)]
        for f in fakes:
            f.fail_after(2)
        running = await _router(fakes, 1)
        url = f"http://127.0.0.1:{running.http_port}"
        try:
            async with httpx.AsyncClient(timeout=20) as c:
                streamed = await c.post(f"{url}/v1/completions", json={
                    "prompt": [7, 9], "max_tokens": 9, "stream": True})
                chunks = [json.loads(e) for e in _events(streamed.text)[:-1]]
                assert sum(1 for ch in chunks if "choices" in ch) == 4  # 2 + 2 after 1 move
                assert chunks[-1]["error"]["message"]
                metrics = (await c.get(f"{url}/metrics")).text
            assert 'pdserve_router_migrations_total{outcome="ok"} 1.0' in metrics
            assert 'pdserve_router_migrations_total{outcome="limit"} 1.0' in metrics
        finally:
            await running.stop()
            for f in fakes:
                await f.stop()
    asyncio.run(asyncio.wait_for(main(), 60))
