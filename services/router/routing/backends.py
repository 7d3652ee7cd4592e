"""The router's instances of one kind, their health, membership and the routing decision.

Lifecycle: `BackendPool(...)` opens one gRPC channel per static instance; `start()` runs a
first round of health checks and then a background task that repeats them every
`interval_s`; `close()` stops the task and closes every channel. An instance is down after
`unhealthy_after` failed checks (or failed calls) in a row and up again after one good check.
Membership also changes at run time: `sync(source, addresses)` (the registry watcher, the
DNS resolver) adds instances (checked at once, used as soon as healthy) and retires those a
source no longer lists (their channels close a minute later, after calls in flight).
`choose()` asks the pool's policy among instances that are up, whose breaker allows and whose
max_model_len leaves room for the prompt; the decision (`Routed`: the instance and the prompt tokens it has not cached) opens the call.
A pool holds one kind of instance: decode (or unified) instances answer health checks on
DecodeService, prefill instances on PrefillService.
Before an instance is used, its Health must name the model the router serves
(`expect_model`, "" -> any) and the model fingerprint the pool's first healthy instance
reported (its block keys must match the others'); an instance that does not stays down, with
a warning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional, Sequence

import grpc

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.common.periodic import Periodic
from pdserve.services.common.tls import TlsConfig
from pdserve.services.router.routing.backend import Backend, Lease, Routed
from pdserve.services.router.routing.breaker import CircuitBreaker
from pdserve.services.router.routing.candidate import Candidate, RouteRequest
from pdserve.services.router.api.errors import context_too_long, unavailable
from pdserve.services.router.dispatch.fallback_config import FallbackConfig
from pdserve.services.router.routing.policies import RoundRobin
from pdserve.services.router.routing.prefix_memory import PrefixMemory

log = logging.getLogger(__name__)
_RETIRE_S = 60.0


def _fits(b: Backend, prompt_len: int) -> bool:
    """Room for the prompt and one generated token (an unknown limit: the instance checks)."""
    return not b.max_model_len or prompt_len < b.max_model_len


class _Mismatch(RuntimeError):
    """The instance serves another model or fingerprint than the pool."""


class BackendPool:
    def __init__(self, addresses: tuple[str, ...], metrics: RouterMetrics, interval_s: float,
                 timeout_s: float, unhealthy_after: int, kind: str = "decode", policy=None,
                 fallback: FallbackConfig = FallbackConfig(), memory_blocks: int = 65536,
                 tls: TlsConfig = TlsConfig(), expect_model: str = ""):
        self.kind = kind
        self._tls = tls  # every instance's channel: mutual TLS when set
        self.expect_model = expect_model
        self.fingerprint = ""  # pinned by the first healthy instance that reports one
        self._refused: set[str] = set()  # addresses warned about (logged once)
        self._fallback = fallback
        self.backends = [self._new(a) for a in addresses]
        self._static = set(addresses)
        self._sources: dict[str, set[str]] = {}
        self._retired: list[tuple[float, Backend]] = []
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._unhealthy_after = unhealthy_after
        self.policy = policy or RoundRobin()
        self.memory = PrefixMemory(memory_blocks)
        self._periodic = Periodic(self._tick, interval_s, f"{kind}-health-checks")

    def _new(self, address: str) -> Backend:
        f = self._fallback
        return Backend(address, self.kind, CircuitBreaker(f.breaker_failures, f.breaker_open_s),
                       tls=self._tls)

    async def start(self) -> None:
        await self.check_all()
        await self._periodic.start(run_now=False)

    async def close(self) -> None:
        await self._periodic.stop()
        old = [b for _, b in self._retired]
        await asyncio.gather(*(b.channel.close() for b in self.backends + old))

    @property
    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.up]

    @property
    def max_model_len(self) -> Optional[int]:
        """The longest context any healthy instance takes (None: none has said). A prompt
        is refused only when no instance can take it; `choose()` then skips the instances
        too small for it. (The minimum let one instance, or anything that passed as one,
        reporting max_model_len=1 refuse every prompt for the whole fleet.)"""
        lens = [b.max_model_len for b in self.healthy if b.max_model_len]
        return max(lens) if lens else None

    def kv_geometry(self) -> Optional[tuple[str, int]]:
        """(model fingerprint, block size) the healthy instances agree on; None when unknown
        or when they disagree (then no block keys can be trusted)."""
        seen = {(b.health.model_fingerprint, b.health.block_size) for b in self.healthy}
        if len(seen) != 1:
            return None
        fingerprint, block_size = seen.pop()
        return (fingerprint, block_size) if fingerprint and block_size else None

    def candidates(self, keys: Sequence[bytes] = (), exclude: tuple[Backend, ...] = (),
                   prompt_len: int = 0) -> list[Candidate]:
        """Instances that may take a prompt of `prompt_len` tokens now (0: any length)."""
        remembered = self.memory.leading(keys) if keys else {}
        return [Candidate(b, b.address, b.active, b.queue_tokens, b.reported.kv_usage,
                          max(remembered.get(b.address, 0), b.summary_prefix(keys)))
                for b in self.backends
                if b.up and b not in exclude and b.breaker.allows()
                and _fits(b, prompt_len)]

    def choose(self, req: RouteRequest = RouteRequest(), keys: Sequence[bytes] = (),
               exclude: tuple[Backend, ...] = ()) -> Routed:
        """The policy's pick; remembers that `keys` went there. 503 when none is left."""
        cands = self.candidates(keys, exclude, req.prompt_len)
        if not cands:
            up = self.healthy
            if up and not any(_fits(b, req.prompt_len) for b in up):
                raise context_too_long(req.prompt_len, self.max_model_len)  # the client's
            raise unavailable(f"no {self.kind} instance is reachable; try again shortly")
        chosen = self.policy.choose(cands, req)
        backend = chosen.ref
        uncached = None  # its queue estimate: the part of the prompt it has not cached
        if req.block_size:
            uncached = max(0, req.prompt_len - req.block_size * chosen.local_blocks)
        if keys:
            self.memory.record(keys, backend.address)
        self._metrics.routed.labels(self.kind, backend.address).inc()
        return Routed(backend, uncached)

    def report_failure(self, backend: Backend, why: str) -> None:
        backend.record_failure(self._unhealthy_after, why)
        self._metrics.instance_up.labels(backend.address).set(int(backend.up))

    def finish(self, lease: Lease, ok: Optional[bool]) -> None:
        """Ends one call's lease; counts a breaker that this failure opened."""
        if lease.finish(ok):
            log.warning("circuit breaker open for %s", lease.backend.address)
            self._metrics.breaker_opened.labels(lease.backend.address).inc()

    def sync(self, source: str, addresses: set[str]) -> None:
        """`source` now lists exactly `addresses`; static instances always stay."""
        self._sources[source] = set(addresses)
        wanted = self._static.union(*self._sources.values())
        have = {b.address for b in self.backends}
        for address in sorted(wanted - have):
            backend = self._new(address)
            self.backends.append(backend)
            asyncio.ensure_future(self._check(backend))  # usable as soon as it answers
            log.info("%s instance %s joined", self.kind, address)
        for backend in [b for b in self.backends if b.address not in wanted]:
            self.backends.remove(backend)
            self.memory.forget(backend.address)
            self._retired.append((time.monotonic(), backend))
            self._metrics.instance_up.labels(backend.address).set(0)
            log.info("%s instance %s left", self.kind, backend.address)

    def backend(self, address: str) -> Optional[Backend]:
        return next((b for b in self.backends if b.address == address), None)

    async def _tick(self) -> None:
        await self.check_all()
        await self._close_retired()

    async def _close_retired(self) -> None:
        now = time.monotonic()
        old = [b for t, b in self._retired if now - t > _RETIRE_S]
        self._retired = [(t, b) for t, b in self._retired if now - t <= _RETIRE_S]
        await asyncio.gather(*(b.channel.close() for b in old), return_exceptions=True)

    def _check_identity(self, health: pb.HealthResponse) -> None:
        """RuntimeError when the instance serves another model or computes other keys."""
        if self.expect_model and health.model and health.model != self.expect_model:
            raise _Mismatch(f"serves model {health.model!r}, not {self.expect_model!r}")
        fp = health.model_fingerprint
        if fp and self.fingerprint and fp != self.fingerprint:
            raise _Mismatch(f"model fingerprint {fp[:16]} differs from the pool's "
                               f"{self.fingerprint[:16]}")
        if fp and not self.fingerprint:
            self.fingerprint = fp

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(b) for b in list(self.backends)))
        if self.kind == "decode":  # the router-wide gauges count decode instances
            up = self.healthy
            self._metrics.running.set(sum(b.load.num_running for b in up))
            self._metrics.waiting.set(sum(b.load.num_waiting for b in up))

    async def _check(self, b: Backend) -> None:
        try:
            health = await b.service.Health(pb.HealthRequest(), timeout=self._timeout_s)
            if health.status != pb.HealthResponse.SERVING:
                raise RuntimeError("instance says NOT_SERVING")
            self._check_identity(health)
            load = await b.service.GetLoad(pb.LoadRequest(), timeout=self._timeout_s)
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            if isinstance(exc, _Mismatch) and b.address not in self._refused:
                self._refused.add(b.address)
                log.warning("%s instance %s refused: %s", self.kind, b.address, why)
            b.record_failure(self._unhealthy_after, why)
        else:
            b.record_success(health, load)
            self._metrics.kv_usage.labels(b.address).set(load.kv_usage)
            if load.HasField("kv"):
                self._metrics.observe_instance_kv(b.address, load.kv)
        if b in self.backends:
            self._metrics.instance_up.labels(b.address).set(int(b.up))
