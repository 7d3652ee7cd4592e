"""Opening a decode (or unified) stream with the ladder's decode rung: an instance that
fails before the first token is streamed is replaced by another (up to `decode_retries`,
with backoff); after tokens were streamed a failure is a clean error to the client.

Lifecycle: `open_decode(...)` picks an instance with the pool's policy, opens the call and
reads until the first token (or the finish) arrives; it returns a PrimedStream that yields
that delta and then the rest. Every call holds a Lease on its instance, closed when the
stream finishes, fails or is cancelled (`cancel()`, idempotent), so the router's load counts
and the instance's circuit breaker stay right.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.routing.backend import Backend, Lease
from pdserve.services.router.routing.backends import BackendPool
from pdserve.services.router.routing.candidate import RouteRequest
from pdserve.services.router.dispatch.engine_stream import Delta, EngineStream
from pdserve.services.router.api.errors import APIError
from pdserve.services.router.dispatch.fallback_config import FallbackConfig
from pdserve.services.router.api.router_tracing import decode_span, outgoing_metadata

log = logging.getLogger(__name__)


def retryable(err: APIError) -> bool:
    """The instance's fault (or it is full): another instance may do better."""
    return err.status >= 500 or err.status == 429


@dataclass(frozen=True)
class DecodeTarget:
    pool: BackendPool
    fallback: FallbackConfig
    metrics: RouterMetrics


async def open_decode(target: DecodeTarget, req: pb.DecodeRequest, route: RouteRequest,
                      keys: Sequence[bytes] = (), tokens_to_compute: int = 0) -> "PrimedStream":
    """`tokens_to_compute`: prompt tokens the instance will compute (its queue estimate)."""
    tried: tuple[Backend, ...] = ()
    retries = target.fallback.decode_retries
    for attempt in range(retries + 1):
        if attempt:
            target.metrics.fallbacks.labels("decode_retry").inc()
            await asyncio.sleep(target.fallback.backoff_s * 2 ** (attempt - 1))
        backend = target.pool.choose(route, keys, exclude=tried)  # 503 when none is left
        tried += (backend,)
        lease = backend.dispatch(tokens_to_compute)
        try:
            return await _prime(target, backend, lease, req)
        except APIError as err:
            target.pool.finish(lease, ok=not retryable(err))
            if not retryable(err) or attempt == retries:
                raise
            _note_failure(target.pool, backend, err)
        except BaseException:
            target.pool.finish(lease, ok=None)
            raise
    raise AssertionError("unreachable")


async def _prime(target: DecodeTarget, backend: Backend, lease: Lease, req):
    with decode_span(backend.address, req.request_id):
        stream = await EngineStream.open(backend, req, target.fallback.stream_idle_timeout_s,
                                         metadata=outgoing_metadata())
    try:
        first = await stream.__anext__()
        while not first.token_ids and first.finish_reason is None:
            first = await stream.__anext__()
    except BaseException:
        stream.cancel()
        raise
    lease.first_token()
    return PrimedStream(stream, first, target, lease)


def _note_failure(pool: BackendPool, backend: Backend, err: APIError) -> None:
    log.warning("decode on %s failed before its first token (%s); trying another",
                backend.address, err.message)
    if err.status == 503:
        pool.report_failure(backend, "UNAVAILABLE")


class PrimedStream:
    def __init__(self, stream: EngineStream, first: Delta, target: DecodeTarget, lease: Lease):
        self._stream = stream
        self._first: Optional[Delta] = first
        self._target = target
        self._lease = lease
        self.backend = stream.backend
        if first.finish_reason is not None:
            target.pool.finish(lease, ok=True)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self._first is not None:
            delta, self._first = self._first, None
            return delta
        try:
            delta = await self._stream.__anext__()
        except APIError as err:
            self._target.metrics.fallbacks.labels("error_after_tokens").inc()
            self._target.pool.finish(self._lease, ok=not retryable(err))
            if err.status == 503:
                self._target.pool.report_failure(self.backend, "UNAVAILABLE")
            raise
        if delta.finish_reason is not None:
            self._target.pool.finish(self._lease, ok=True)
        return delta

    def cancel(self) -> None:
        self._stream.cancel()
        self._target.pool.finish(self._lease, ok=None)
