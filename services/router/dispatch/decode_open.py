"""Opening a decode (or unified) stream with the ladder's decode rung: an instance that
fails before the first token is streamed is replaced by another (up to `decode_retries`,
with backoff). After tokens were streamed, a failure of the instance (it died, was cut off,
went silent, ended early: any 5xx) migrates the request: the prompt plus every token already
delivered goes to another decode instance as `resumed_token_ids` (it loads the prompt blocks
the store holds, computes the rest, and continues after the last delivered token), and the
client's stream goes on with the next token: no error, nothing repeated or missing. Greedy
output equals the uninterrupted one. At most `max_migrations` per stream; every attempt is
counted (pdserve_router_migrations: ok, failed, limit). When no migration is possible the
original failure reaches the client as a clean error.

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
                      keys: Sequence[bytes] = (), tokens_to_compute: int = 0,
                      exclude: tuple[Backend, ...] = (), migrations: int = 0,
                      ) -> "PrimedStream":
    """`tokens_to_compute`: prompt tokens the instance will compute (its queue estimate);
    `exclude`: instances not to use; `migrations`: times this stream already moved."""
    tried: tuple[Backend, ...] = exclude
    retries = target.fallback.decode_retries
    for attempt in range(retries + 1):
        if attempt:
            target.metrics.fallbacks.labels("decode_retry").inc()
            await asyncio.sleep(target.fallback.backoff_s * 2 ** (attempt - 1))
        routed = target.pool.choose(route, keys, exclude=tried)  # 503 when none is left
        backend = routed.backend
        tried += (backend,)
        lease = routed.dispatch(tokens_to_compute)
        try:
            primed = await _prime(target, backend, lease, req)
            primed.resume = _Resume(req, route, tuple(keys), migrations, exclude)
            return primed
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


@dataclass(frozen=True)
class _Resume:
    """What a migration needs: the request that opened the stream and how it was routed."""

    req: pb.DecodeRequest
    route: RouteRequest
    keys: tuple
    migrations: int  # times the stream moved before this request
    failed: tuple = ()  # instances this stream failed on: not tried again


def _delivered_before(req: pb.DecodeRequest) -> list[int]:
    """Output tokens the client had before `req` was sent."""
    if req.HasField("first_token_id"):
        return [req.first_token_id]
    return list(req.resumed_token_ids)


def migrated_request(req: pb.DecodeRequest, delivered: list[int], n: int) -> pb.DecodeRequest:
    """`req` continued on another instance after the `delivered` output tokens."""
    base = req.request_id.rsplit("-m", 1)[0] if n > 1 else req.request_id
    out = pb.DecodeRequest(request_id=f"{base}-m{n}",
                           prompt_token_ids=req.prompt_token_ids, params=req.params,
                           block_keys=req.block_keys, resumed_token_ids=delivered)
    if req.HasField("cache_salt"):
        out.cache_salt = req.cache_salt
    return out


class PrimedStream:
    def __init__(self, stream: EngineStream, first: Delta, target: DecodeTarget, lease: Lease):
        self._stream = stream
        self._first: Optional[Delta] = first
        self._target = target
        self._lease = lease
        self.backend = stream.backend
        self.resume: Optional[_Resume] = None  # set by open_decode: makes migration possible
        self._streamed: list[int] = []  # output tokens this stream delivered
        self._cancelled = False
        if first.finish_reason is not None:
            target.pool.finish(lease, ok=True)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self._first is not None:
            delta, self._first = self._first, None
            self._streamed.extend(delta.token_ids)
            return delta
        while True:
            try:
                delta = await self._stream.__anext__()
                break
            except APIError as err:
                self._failed(err)
                if not await self._migrate(err):
                    self._target.metrics.fallbacks.labels("error_after_tokens").inc()
                    raise
                if self._first is not None:  # the new instance's first delta
                    delta, self._first = self._first, None
                    break
        self._streamed.extend(delta.token_ids)
        if delta.finish_reason is not None:
            self._target.pool.finish(self._lease, ok=True)
        return delta

    def _failed(self, err: APIError) -> None:
        self._target.pool.finish(self._lease, ok=not retryable(err))
        if err.status in (502, 503):
            self._target.pool.report_failure(self.backend, "UNAVAILABLE")

    async def _migrate(self, err: APIError) -> bool:
        """Continues on another instance; False when the stream cannot move."""
        r, limit = self.resume, self._target.fallback.max_migrations
        if r is None or err.status < 500 or self._cancelled:
            return False
        metrics = self._target.metrics.migrations
        if r.migrations >= limit:
            metrics.labels("limit").inc()
            return False
        delivered = _delivered_before(r.req) + self._streamed
        req = migrated_request(r.req, delivered, r.migrations + 1)
        log.warning("decode on %s failed after %d tokens (%s); migrating %s", self.backend.address,
                    len(delivered), err.message, r.req.request_id)
        try:
            nxt = await open_decode(self._target, req, r.route, r.keys,
                                    len(req.prompt_token_ids) + len(delivered),
                                    exclude=r.failed + (self.backend,),
                                    migrations=r.migrations + 1)
        except APIError as again:
            metrics.labels("failed").inc()
            log.warning("migration of %s failed: %s", r.req.request_id, again.message)
            return False
        metrics.labels("ok").inc()
        # the new stream's first delta comes next; what this one delivered stays counted
        self._stream, self._first, self._lease = nxt._stream, nxt._first, nxt._lease
        self.backend, self.resume = nxt.backend, nxt.resume
        self._streamed = []
        return True

    def cancel(self) -> None:
        self._cancelled = True
        self._stream.cancel()
        self._target.pool.finish(self._lease, ok=None)
