"""Streaming client for OpenAI-compatible servers: /v1/completions and /v1/chat/completions.

It speaks HTTP through bench/http_stream.py, not httpx: the client runs on the cores it
measures, and httpx's CPU per streamed token showed up in the served ITL.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

from pdserve.bench.http_stream import Endpoint, HttpStreamError, request
from pdserve.bench.record import StreamTrace
from pdserve.bench.request import BenchRequest
from pdserve.bench.sse import apply_chunk
from pdserve.bench.target import TargetConfig

# failures of one exchange: the connection, a timeout, the protocol, a bad JSON event
FAILURES = (HttpStreamError, OSError, asyncio.TimeoutError, ValueError)


class HttpClient:
    def __init__(self, target: TargetConfig):
        self._t = target
        self._model = target.model_name
        # One connection per request, no cap: the arrival process decides what is in flight.
        self._ep = Endpoint.parse(target.base_url)

    async def start(self) -> None:
        if not self._model:
            resp = await request(self._ep, "GET", "/v1/models", timeout_s=60.0)
            if resp.status != 200:
                raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: "
                                   f"{resp.body[:300].decode(errors='replace')}")
            self._model = json.loads(resp.body)["data"][0]["id"]

    @property
    def model(self) -> str:
        return self._model

    async def close(self) -> None:
        pass  # connections close with their responses

    def _body(self, req: BenchRequest, messages: Optional[list[dict]]) -> tuple[str, dict]:
        body = {"model": self._model, "max_tokens": req.max_tokens, "stream": True,
                "stream_options": {"include_usage": True},
                "temperature": self._t.temperature, "ignore_eos": self._t.ignore_eos}
        if self._t.top_p < 1:
            body["top_p"] = self._t.top_p
        if req.is_chat:
            return "/v1/chat/completions", dict(body, messages=messages)
        prompt = req.prompt if req.prompt is not None else list(req.prompt_ids)
        return "/v1/completions", dict(body, prompt=prompt)

    async def send(self, req: BenchRequest, messages: Optional[list[dict]],
                   trace: StreamTrace) -> None:
        path, body = self._body(req, messages)
        try:
            resp = await request(self._ep, "POST", path, body,
                                 sink=lambda data, t: apply_chunk(trace, data, t),
                                 timeout_s=self._t.timeout_s)
            if resp.status != 200:
                trace.error = f"HTTP {resp.status}: {resp.body.decode(errors='replace')[:300]}"
        except FAILURES as exc:
            trace.error = f"{type(exc).__name__}: {exc}"
        finally:
            trace.done_t = time.perf_counter()
