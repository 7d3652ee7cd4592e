"""The standard gRPC services every pdserve gRPC server offers next to its own.

- `grpc.health.v1.Health` (what Kubernetes gRPC probes, grpcurl and grpc-health-probe ask):
  its answer comes from a probe the server passes in, evaluated on every Check and polled while
  a Watch is open, so it is never stale. An engine whose loop died answers NOT_SERVING; once
  `stop_serving()` is called (the server begins draining or its graceful stop) every answer is
  NOT_SERVING for good, so probes turn traffic away during the grace period.
- Server reflection (`grpc.reflection.v1alpha.ServerReflection`, what grpcurl and
  grpcio-reflection's client speak) lists the server's services and serves their descriptors.

The service names a server answers for are "" (the whole server) and each of its own services'
full names; any other name gets NOT_FOUND, as the health protocol asks.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health as _health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def service_names(*descriptors_and_names: tuple) -> tuple[str, ...]:
    """Full service names from (file descriptor, service name) pairs, e.g.
    `service_names((engine_pb2.DESCRIPTOR, "DecodeService"))`."""
    return tuple(d.services_by_name[n].full_name for d, n in descriptors_and_names)


class StandardHealth(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for one server whose state is `serving()` (cheap, non-blocking: it is
    called on the event loop for each Check and every `poll_s` per open Watch)."""

    def __init__(self, services: Iterable[str], serving: Callable[[], bool],
                 poll_s: float = 0.5):
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self._services = frozenset(services) | {_health.OVERALL_HEALTH}
        self._serving = serving
        self._poll_s = poll_s
        self._stopped = asyncio.Event()

    def stop_serving(self) -> None:
        """Every service answers NOT_SERVING from now on (draining or shutting down)."""
        self._stopped.set()

    def status(self, service: str = "") -> int:
        if service not in self._services:
            return SERVICE_UNKNOWN
        if self._stopped.is_set() or not self._serving():
            return NOT_SERVING
        return SERVING

    async def Check(self, request, context):
        status = self.status(request.service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request, context):
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=self.status(name))
            for name in sorted(self._services)})

    async def Watch(self, request, context):
        """Sends the status now and again on each change (an unknown service: SERVICE_UNKNOWN,
        as the protocol says; the call stays open until the client leaves)."""
        last = None
        while True:
            status = self.status(request.service)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            try:
                await asyncio.wait_for(self._stopped.wait(), self._poll_s)
            except asyncio.TimeoutError:
                pass
            if self._stopped.is_set() and last == NOT_SERVING:
                await asyncio.sleep(self._poll_s)  # nothing changes after stop: just idle


def add_standard_services(server: grpc.aio.Server, services: Sequence[str],
                          serving: Callable[[], bool]) -> StandardHealth:
    """Adds grpc.health.v1 and reflection for `services` (full names) to `server` (before it
    starts); returns the health servicer, whose `stop_serving()` the server's stop calls."""
    health = StandardHealth(services, serving)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (*services, _health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return health
