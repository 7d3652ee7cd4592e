"""The router process: HTTP (uvicorn + FastAPI) and gRPC (grpc.aio) on one event loop.

Lifecycle: `start_router` loads the tokenizer, runs a first round of instance health checks
(decode instances, and in disaggregated mode prefill instances too, plus a channel to the KV
store master), starts the membership watchers (registry, DNS) when configured, starts the
gRPC server and uvicorn, and returns once both listen. `RunningRouter.stop()` stops taking
requests, lets those in flight finish for `grace_s` (then cancels them, which aborts them in
their engines), stops the watchers and the health checks and closes the channels.
`run_router` wraps the two around waiting for SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import grpc
import uvicorn

from pdserve.common.rpc import router_pb2 as pb
from pdserve.common.rpc import router_pb2_grpc as pb_grpc
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.common.gc_heap import freeze_startup_heap
from pdserve.services.common.grpc_limits import grpc_limits
from pdserve.services.common.grpc_standard import (StandardHealth, add_standard_services,
                                                    service_names)
from pdserve.services.common.signals import wait_for_signal
from pdserve.services.common.tls import add_port
from pdserve.services.router.routing.backends import BackendPool
from pdserve.services.registry.config import RegistryConfig
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.routing.dns_watch import DnsWatcher, split_dns
from pdserve.services.router.admission.gate import Gate
from pdserve.services.router.routing.policies import make_policy
from pdserve.services.router.routing.registry_watch import RegistryWatcher
from pdserve.services.router.api.router_tracing import setup_router_tracing
from pdserve.services.router.api.grpc_servicer import RouterServicer
from pdserve.services.router.api.http_app import build_app
from pdserve.services.router.api.http_protocol import head_timeout_protocol
from pdserve.services.router.state import RouterState
from pdserve.services.router.api.tokenizer_loader import load_tokenizer
from pdserve.services.router.workers import per_worker, reuseport_socket, worker_metrics

log = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: this process decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class RunningRouter:
    state: RouterState
    http: _Uvicorn
    http_task: asyncio.Task
    grpc_server: Optional[grpc.aio.Server]
    http_port: int
    grpc_port: Optional[int]
    watchers: tuple = ()
    health: Optional[StandardHealth] = None  # grpc.health.v1 on the gRPC port

    async def stop(self) -> None:
        if self.health is not None:
            self.health.stop_serving()
        self.http.should_exit = True
        stops = [self.http_task]
        if self.grpc_server is not None:
            stops.append(self.grpc_server.stop(self.state.config.grace_s))
        await asyncio.gather(*stops, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in self.watchers), return_exceptions=True)
        await self.state.pool.close()
        await self.state.dispatch.close()


async def start_router(cfg: RouterConfig, tokenizer=None,
                       before_listen: Optional[Callable[[], object]] = None) -> RunningRouter:
    """With cfg.worker_index >= 0 this is one of cfg.workers processes sharing the ports
    (services/router/workers.py): its share of the limits, SO_REUSEPORT, shared metrics.
    `before_listen`: runs once everything is built and before either port takes a request
    (the entry point freezes its start-up heap there); None -> nothing."""
    worker = cfg.worker_index >= 0
    if worker:
        cfg = per_worker(cfg)
    metrics = worker_metrics() if worker else RouterMetrics()
    pool = _pool(cfg, metrics, cfg.backends, "decode")
    state = RouterState(cfg, tokenizer or load_tokenizer(cfg.model), pool, metrics, None,
                        Gate(cfg, metrics))
    disagg = _disagg_router(cfg, state, metrics) if cfg.disaggregated else None
    if disagg is not None:
        state = dataclasses.replace(state, dispatch=disagg)
    await pool.start()
    if disagg is not None:
        await disagg.prefill.start()
    watchers = await _watchers(cfg, pool, disagg.prefill if disagg is not None else None)
    grpc_server, grpc_port, health = _grpc_server(cfg, state, worker)
    http = _http_server(cfg, state)
    if before_listen is not None:
        before_listen()
    if grpc_server is not None:
        await grpc_server.start()
    # a worker binds its own SO_REUSEPORT socket; uvicorn listens on it
    sockets = [reuseport_socket(cfg.host, cfg.port)] if worker else None
    task = asyncio.create_task(http.serve(sockets=sockets), name="uvicorn")
    while not http.started:
        if task.done():  # it failed to bind, say
            await task
            raise OSError(f"HTTP server on {cfg.host}:{cfg.port} did not start")
        await asyncio.sleep(0.02)
    http_port = http.servers[0].sockets[0].getsockname()[1]
    return RunningRouter(state, http, task, grpc_server, http_port, grpc_port, watchers, health)


def _grpc_server(cfg: RouterConfig, state: RouterState, worker: bool):
    """The gRPC server with its port bound, not yet started: (server, port, health), or
    Nones when cfg.grpc_port < 0."""
    if cfg.grpc_port < 0:
        return None, None, None
    server = grpc.aio.server(
        options=grpc_limits(cfg.limits.grpc_max_message_bytes)
        + ([("grpc.so_reuseport", 1)] if worker else []),
        maximum_concurrent_rpcs=cfg.limits.grpc_max_concurrent_rpcs)
    pb_grpc.add_RouterServicer_to_server(RouterServicer(state), server)
    health = add_standard_services(server, service_names((pb.DESCRIPTOR, "Router")),
                                   lambda: bool(state.pool.healthy))
    port = add_port(server, f"{cfg.host}:{cfg.grpc_port}", cfg.tls)
    if port == 0:
        raise OSError(f"cannot listen on {cfg.host}:{cfg.grpc_port}")
    return server, port, health


def _http_server(cfg: RouterConfig, state: RouterState) -> _Uvicorn:
    lim = cfg.limits
    return _Uvicorn(uvicorn.Config(build_app(state), host=cfg.host, port=cfg.port,
                                   log_level="warning", lifespan="off",
                                   timeout_graceful_shutdown=max(1, int(cfg.grace_s)),
                                   # a backstop on connections: requests past
                                   # http_max_concurrency get an OpenAI-shaped 503 first
                                   limit_concurrency=2 * lim.http_max_concurrency + 64,
                                   timeout_keep_alive=lim.http_keep_alive_s,
                                   h11_max_incomplete_event_size=lim.http_max_header_bytes,
                                   http=head_timeout_protocol(lim.http_header_timeout_s,
                                                             lim.http_max_header_bytes)))


def _pool(cfg: RouterConfig, metrics: RouterMetrics, addresses, kind: str) -> BackendPool:
    plain, _ = split_dns(addresses)
    policy = cfg.routing.decode_policy if kind == "decode" else cfg.routing.prefill_policy
    return BackendPool(plain, metrics, cfg.health_interval_s, cfg.health_timeout_s,
                       cfg.unhealthy_after, kind=kind, policy=make_policy(policy, cfg.routing),
                       fallback=cfg.fallback, memory_blocks=cfg.routing.prefix_memory_blocks,
                       tls=cfg.tls, expect_model=cfg.model)


async def _watchers(cfg: RouterConfig, decode: BackendPool, prefill) -> tuple:
    """Membership sources beyond the static lists: dns: entries and the registry."""
    watchers = []
    for pool, addresses in ((decode, cfg.backends), (prefill, cfg.prefill_backends)):
        _, dns = split_dns(addresses)
        if dns and pool is not None:
            watchers.append(await DnsWatcher(dns, pool, cfg.dns_interval_s).start())
    if cfg.registry_url:
        reg = RegistryConfig(cfg.registry_url, ttl_s=max(3.0, 2 * cfg.registry_interval_s),
                             interval_s=cfg.registry_interval_s)
        watchers.append(await RegistryWatcher(reg, {"decode": decode, "prefill": prefill},
                                              model=cfg.model).start())
    return tuple(watchers)


def _disagg_router(cfg: RouterConfig, state: RouterState, metrics: RouterMetrics):
    from pdserve.services.router.dispatch.disagg import DisaggRouter
    from pdserve.services.router.routing.kv_lookup import StoreIndex

    prefill = _pool(cfg, metrics, cfg.prefill_backends, "prefill")
    index = StoreIndex(cfg.kv_store, metrics, cfg.kv_lookup_timeout_s,
                       block_secret_file=cfg.kv_block_secret_file, tls=cfg.tls)
    return DisaggRouter(cfg, prefill, state.decode_target, index)


async def run_router(cfg: RouterConfig) -> None:
    tracing = setup_router_tracing()
    # start-up's objects out of the collector's full passes, before a request can meet that pass
    running = await start_router(cfg, before_listen=freeze_startup_heap)
    log.info("router for %s: http %s:%d, grpc %s, instances %s%s", cfg.model_name, cfg.host,
             running.http_port, running.grpc_port, ",".join(cfg.backends),
             f"; prefill {','.join(cfg.prefill_backends)}, kv store {cfg.kv_store}"
             if cfg.disaggregated else "")
    await wait_for_signal()
    log.info("shutting down")
    await running.stop()
    tracing.shutdown()
