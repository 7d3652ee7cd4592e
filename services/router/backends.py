"""The router's static list of engine instances and their health.

Lifecycle: `BackendPool(...)` opens one gRPC channel per instance; `start()` runs a first round
of health checks and then a background task that repeats them every `interval_s`; `close()`
stops the task and closes the channels. An instance is down after `unhealthy_after` failed
checks (or failed calls) in a row and up again after one good check. `pick()` goes round-robin
over the instances that are up. A pool holds one kind of instance: decode (or unified)
instances answer health checks on DecodeService, prefill instances on PrefillService.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Optional

import grpc

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.errors import unavailable

log = logging.getLogger(__name__)


class Backend:
    def __init__(self, address: str, kind: str = "decode"):
        if kind not in ("decode", "prefill"):
            raise ValueError(f"kind must be decode or prefill, got {kind!r}")
        self.address = address
        self.kind = kind
        self.channel = grpc.aio.insecure_channel(address)
        self.decode = pb_grpc.DecodeServiceStub(self.channel)
        self.prefill = pb_grpc.PrefillServiceStub(self.channel)
        self.service = self.decode if kind == "decode" else self.prefill  # Health, GetLoad
        self.up = False  # unknown counts as down until a check passes
        self.failures = 0
        self.max_model_len: Optional[int] = None
        self.load: Optional[pb.LoadResponse] = None
        self.health: Optional[pb.HealthResponse] = None  # the last good answer

    def record_failure(self, unhealthy_after: int, why: str) -> None:
        self.failures += 1
        if self.up and self.failures >= unhealthy_after:
            self.up = False
            log.warning("instance %s is down: %s", self.address, why)

    def record_success(self, health: pb.HealthResponse, load: pb.LoadResponse) -> None:
        if not self.up:
            log.info("instance %s is up (%s, role %s)", self.address, health.model, health.role)
        self.up, self.failures = True, 0
        self.max_model_len = health.max_model_len or None
        self.load = load
        self.health = health


class BackendPool:
    def __init__(self, addresses: tuple[str, ...], metrics: RouterMetrics, interval_s: float,
                 timeout_s: float, unhealthy_after: int, kind: str = "decode"):
        self.kind = kind
        self.backends = [Backend(a, kind) for a in addresses]
        self._metrics = metrics
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._unhealthy_after = unhealthy_after
        self._rr = itertools.count()
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="health-checks")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(b.channel.close() for b in self.backends))

    @property
    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.up]

    @property
    def max_model_len(self) -> Optional[int]:
        lens = [b.max_model_len for b in self.healthy if b.max_model_len]
        return min(lens) if lens else None

    def kv_geometry(self) -> Optional[tuple[str, int]]:
        """(model fingerprint, block size) the healthy instances agree on; None when unknown
        or when they disagree (then no block keys can be trusted)."""
        seen = {(b.health.model_fingerprint, b.health.block_size) for b in self.healthy}
        if len(seen) != 1:
            return None
        fingerprint, block_size = seen.pop()
        return (fingerprint, block_size) if fingerprint and block_size else None

    def pick(self, exclude: tuple[Backend, ...] = ()) -> Backend:
        up = [b for b in self.healthy if b not in exclude]
        if not up:
            raise unavailable(f"no {self.kind} instance is reachable; try again shortly")
        return up[next(self._rr) % len(up)]

    def report_failure(self, backend: Backend, why: str) -> None:
        backend.record_failure(self._unhealthy_after, why)
        self._metrics.instance_up.labels(backend.address).set(int(backend.up))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(b) for b in self.backends))
        if self.kind == "decode":  # the router-wide gauges count decode instances
            up = self.healthy
            self._metrics.running.set(sum(b.load.num_running for b in up))
            self._metrics.waiting.set(sum(b.load.num_waiting for b in up))

    async def _check(self, b: Backend) -> None:
        try:
            health = await b.service.Health(pb.HealthRequest(), timeout=self._timeout_s)
            if health.status != pb.HealthResponse.SERVING:
                raise RuntimeError("instance says NOT_SERVING")
            load = await b.service.GetLoad(pb.LoadRequest(), timeout=self._timeout_s)
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            b.record_failure(self._unhealthy_after, why)
        else:
            b.record_success(health, load)
            self._metrics.kv_usage.labels(b.address).set(load.kv_usage)
            if load.HasField("kv"):
                self._metrics.observe_instance_kv(b.address, load.kv)
        self._metrics.instance_up.labels(b.address).set(int(b.up))
