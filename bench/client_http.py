"""Streaming client for OpenAI-compatible servers: /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import time
from typing import Optional

import httpx

from pdserve.bench.record import StreamTrace
from pdserve.bench.request import BenchRequest
from pdserve.bench.sse import apply_chunk, sse_lines
from pdserve.bench.target import TargetConfig


class HttpClient:
    def __init__(self, target: TargetConfig):
        self._t = target
        self._model = target.model_name
        self._http: Optional[httpx.AsyncClient] = None

    async def start(self) -> None:
        # No connection cap: the arrival process, not the pool, decides what is in flight.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._http = httpx.AsyncClient(base_url=self._t.base_url, limits=limits,
                                       timeout=httpx.Timeout(self._t.timeout_s, connect=30.0))
        if not self._model:
            resp = await self._http.get("/v1/models")
            resp.raise_for_status()
            self._model = resp.json()["data"][0]["id"]

    @property
    def model(self) -> str:
        return self._model

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    def _body(self, req: BenchRequest, messages: Optional[list[dict]]) -> tuple[str, dict]:
        body = {"model": self._model, "max_tokens": req.max_tokens, "stream": True,
                "stream_options": {"include_usage": True},
                "temperature": self._t.temperature, "ignore_eos": self._t.ignore_eos}
        if req.is_chat:
            return "/v1/chat/completions", dict(body, messages=messages)
        prompt = req.prompt if req.prompt is not None else list(req.prompt_ids)
        return "/v1/completions", dict(body, prompt=prompt)

    async def send(self, req: BenchRequest, messages: Optional[list[dict]],
                   trace: StreamTrace) -> None:
        path, body = self._body(req, messages)
        try:
            async with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    trace.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return
                async for line in sse_lines(resp.aiter_bytes()):
                    if line.startswith("data:") and not apply_chunk(
                            trace, line[5:].strip(), time.perf_counter()):
                        break
        except (httpx.HTTPError, ValueError) as exc:
            trace.error = f"{type(exc).__name__}: {exc}"
        finally:
            trace.done_t = time.perf_counter()
