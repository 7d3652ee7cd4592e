"""Runs a Job: one EngineStream per choice, their deltas merged in arrival order.

Lifecycle: `JobRun.open(open_stream, ...)` opens every choice's stream through `open_stream`
(RouterState.open_stream: colocated or disaggregated) (all accepted, or none left open: on
any failure or cancellation the opened ones are cancelled); iterate it for (index, Delta);
`close()` (idempotent; `async with` calls it) cancels whatever is still running, which aborts
those requests in their engines. An admission `ticket` (optional) is told of the first token
and released on close. The merge queue is bounded, so a slow client slows only its
own streams (gRPC flow control pushes back to the instance, which coalesces, never blocks).
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import grpc

from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.api.errors import APIError
from pdserve.services.router.dispatch.engine_stream import Delta
from pdserve.services.router.dispatch.job import Job

_DONE = object()


def _cut_short(index: int) -> APIError:
    """A stream that ended without its last delta: never passed off as an answer."""
    return APIError(502, f"choice {index}: the instance's stream ended before the answer was "
                    "complete", type_="internal_error", grpc_code=grpc.StatusCode.INTERNAL)


class JobRun:
    def __init__(self, job: Job, streams: list, metrics: RouterMetrics,
                 arrival: float, ticket=None, priority: int = 0):
        self.job = job
        self._streams = streams
        self._ticket = ticket
        self._latency = _LatencyTracker(metrics, arrival, len(streams), ticket, priority)
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(streams))
        self._pumps: list[asyncio.Task] = []

    @classmethod
    async def open(cls, open_stream, job: Job, metrics: RouterMetrics,
                   arrival: Optional[float] = None, ticket=None,
                   priority: int = 0) -> "JobRun":
        """open_stream(request_id, prompt, params, cache_salt) -> a stream of Deltas with
        cancel(). The ticket is released here when opening fails. `priority`: the admitted
        tier, the label of the latency histograms."""
        arrival = time.monotonic() if arrival is None else arrival
        tasks = [asyncio.ensure_future(open_stream(
            f"{job.request_id}-{c.index}", list(c.prompt_token_ids), c.params,
            job.cache_salt)) for c in job.choices]
        try:
            streams = list(await asyncio.gather(*tasks))
        except BaseException:
            if ticket is not None:
                ticket.release()
            for t in tasks:
                t.cancel()
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                if not isinstance(r, BaseException):
                    r.cancel()
            raise
        return cls(job, streams, metrics, arrival, ticket, priority)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._ticket is not None:
            self._ticket.release()
        for t in self._pumps:
            t.cancel()
        for s in self._streams:
            s.cancel()

    async def deltas(self):
        """Yields (choice index, Delta) until every choice finished; raises APIError, also
        when a stream ends without a finish reason (so a 200 is always a whole answer)."""
        if len(self._streams) == 1:
            finished = False
            async for delta in self._streams[0]:
                self._latency.observe(0, delta)
                finished = finished or delta.finish_reason is not None
                yield 0, delta
            if not finished:
                raise _cut_short(0)
            return
        self._pumps = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        remaining = len(self._pumps)
        while remaining:
            item = await self._queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                self._latency.observe(*item)
                yield item

    async def _pump(self, index: int, stream) -> None:
        try:
            finished = False
            async for delta in stream:
                finished = finished or delta.finish_reason is not None
                await self._queue.put((index, delta))
            await self._queue.put(_DONE if finished else _cut_short(index))
        except Exception as exc:  # handed to the reader, which raises it
            await self._queue.put(exc)


class _LatencyTracker:
    """TTFT, inter-token latency and end-to-end latency, measured where the client sees them."""

    def __init__(self, metrics: RouterMetrics, arrival: float, n: int, ticket=None,
                 priority: int = 0):
        self._m = metrics
        tier = str(priority)  # children looked up once, not per token
        self._ttft, self._itl, self._e2e = (metrics.ttft.labels(tier), metrics.itl.labels(tier),
                                            metrics.e2e.labels(tier))
        self._ticket = ticket
        self._arrival = arrival
        self._last: list[Optional[float]] = [None] * n
        self._first_seen = False

    def observe(self, index: int, delta: Delta) -> None:
        k = len(delta.token_ids)
        now = time.monotonic()
        if k:
            last = self._last[index]
            if last is None:
                if not self._first_seen:  # the request's first token, over all choices
                    self._first_seen = True
                    self._ttft.observe(now - self._arrival)
                    if self._ticket is not None:
                        self._ticket.first_token()
            else:
                gap = (now - last) / k  # a merged delta spreads its gap over its tokens
                for _ in range(k):
                    self._itl.observe(gap)
            self._last[index] = now
            self._m.generation_tokens.inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            self._e2e.observe(now - self._arrival)
            self._m.prompt_tokens.inc(delta.num_prompt_tokens)
