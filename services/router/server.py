"""The router process: HTTP (uvicorn + FastAPI) and gRPC (grpc.aio) on one event loop.

Lifecycle: `start_router` loads the tokenizer, runs a first round of instance health checks
(decode instances, and in disaggregated mode prefill instances too, plus a channel to the KV
store master), starts the gRPC server and uvicorn, and returns once both listen.
`RunningRouter.stop()` stops taking requests, lets those in flight finish for `grace_s` (then
cancels them, which aborts them in their engines), stops the health checks and closes the
channels.
`run_router` wraps the two around waiting for SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Optional

import grpc
import uvicorn

from pdserve.common.rpc import router_pb2_grpc as pb_grpc
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.common.engine_server import wait_for_signal
from pdserve.services.router.backends import BackendPool
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.grpc_servicer import RouterServicer
from pdserve.services.router.http_app import build_app
from pdserve.services.router.state import RouterState
from pdserve.services.router.tokenizer_loader import load_tokenizer

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

    async def stop(self) -> None:
        self.http.should_exit = True
        stops = [self.http_task]
        if self.grpc_server is not None:
            stops.append(self.grpc_server.stop(self.state.config.grace_s))
        await asyncio.gather(*stops, return_exceptions=True)
        await self.state.pool.close()
        if self.state.disagg is not None:
            await self.state.disagg.close()


async def start_router(cfg: RouterConfig, tokenizer=None) -> RunningRouter:
    metrics = RouterMetrics()
    pool = BackendPool(cfg.backends, metrics, cfg.health_interval_s, cfg.health_timeout_s,
                       cfg.unhealthy_after)
    disagg = _disagg_router(cfg, pool, metrics) if cfg.disaggregated else None
    state = RouterState(cfg, tokenizer or load_tokenizer(cfg.model), pool, metrics, disagg)
    await pool.start()
    if disagg is not None:
        await disagg.prefill.start()
    grpc_server, grpc_port = None, None
    if cfg.grpc_port >= 0:
        grpc_server = grpc.aio.server()
        pb_grpc.add_RouterServicer_to_server(RouterServicer(state), grpc_server)
        grpc_port = grpc_server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
        if grpc_port == 0:
            raise OSError(f"cannot listen on {cfg.host}:{cfg.grpc_port}")
        await grpc_server.start()
    http = _Uvicorn(uvicorn.Config(build_app(state), host=cfg.host, port=cfg.port,
                                   log_level="warning", lifespan="off",
                                   timeout_graceful_shutdown=max(1, int(cfg.grace_s))))
    task = asyncio.create_task(http.serve(), name="uvicorn")
    while not http.started:
        if task.done():  # it failed to bind, say
            await task
            raise OSError(f"HTTP server on {cfg.host}:{cfg.port} did not start")
        await asyncio.sleep(0.02)
    http_port = http.servers[0].sockets[0].getsockname()[1]
    return RunningRouter(state, http, task, grpc_server, http_port, grpc_port)


def _disagg_router(cfg: RouterConfig, decode: BackendPool, metrics: RouterMetrics):
    from pdserve.services.router.disagg import DisaggRouter
    from pdserve.services.router.kv_lookup import StoreIndex

    prefill = BackendPool(cfg.prefill_backends, metrics, cfg.health_interval_s,
                          cfg.health_timeout_s, cfg.unhealthy_after, kind="prefill")
    index = StoreIndex(cfg.kv_store, metrics, cfg.kv_lookup_timeout_s)
    return DisaggRouter(cfg, prefill, decode, index, metrics)


async def run_router(cfg: RouterConfig) -> None:
    running = await start_router(cfg)
    log.info("router for %s: http %s:%d, grpc %s, instances %s%s", cfg.model_name, cfg.host,
             running.http_port, running.grpc_port, ",".join(cfg.backends),
             f"; prefill {','.join(cfg.prefill_backends)}, kv store {cfg.kv_store}"
             if cfg.disaggregated else "")
    await wait_for_signal()
    log.info("shutting down")
    await running.stop()
