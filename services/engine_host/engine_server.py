"""One engine instance as a gRPC server: the role decides which services it offers.

Lifecycle: `build_core` loads the model (slow, before anything listens); `start_engine_server`
starts the engine thread, the grpc.aio server on the running loop and, with `metrics_port`,
the Prometheus /metrics HTTP server (prometheus_client's own, on a thread), and returns them;
`run_engine_server` sets up tracing, does that, waits for the engine thread's warm-up
(common/engine/startup.py: Health says NOT_SERVING until it is done), registers in the instance registry when one
is configured, then waits for SIGTERM/SIGINT and drains: deregister (routers stop choosing
it), refuse new requests (Health NOT_SERVING, submits UNAVAILABLE, which routers retry
elsewhere), let the requests running finish and their pending KV saves complete, up to
`drain_timeout_s`; then stop accepting calls (in-flight ones get `grace_s`), stop /metrics,
stop the engine thread, flush the spans still buffered, and exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import grpc

from pdserve.common.rpc import engine_pb2
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.services.common.gc_heap import freeze_startup_heap
from pdserve.services.common.grpc_limits import grpc_limits
from pdserve.services.common.grpc_standard import (StandardHealth, add_standard_services,
                                                    service_names)
from pdserve.services.common.signals import wait_for_signal
from pdserve.services.common.tls import add_port
from pdserve.services.common.tls_roles import ENGINE_CALLERS, interceptors_for
from pdserve.common.engine.step_budget import StepBudgetConfig, StepBudgetController
from pdserve.common.telemetry.engine_metrics import EngineMetrics
from pdserve.common.telemetry.tracing import Tracing, setup_tracing
from pdserve.services.engine_host.step_log import step_log_from_env
from pdserve.services.engine_host.async_engine import AsyncEngine
from pdserve.services.engine_host.engine_telemetry import EngineTelemetry
from pdserve.services.engine_host.build_thread import run_on_exiting_thread
from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
from pdserve.services.engine_host.health import InstanceInfo
from pdserve.services.engine_host.kv_connector_factory import connector_factory, rank_kv_factory

log = logging.getLogger(__name__)


@dataclass
class RunningEngineServer:
    server: grpc.aio.Server
    engine: AsyncEngine
    port: int
    metrics: EngineMetrics
    metrics_http: Optional[object] = None  # the /metrics HTTP server, when one listens
    health: Optional[StandardHealth] = None  # grpc.health.v1; stop_serving() when draining

    async def stop(self, grace_s: float) -> None:
        if self.health is not None:
            self.health.stop_serving()
        await self.server.stop(grace_s)
        loop = asyncio.get_running_loop()
        if self.metrics_http is not None:
            await loop.run_in_executor(None, self.metrics_http.shutdown)
            self.metrics_http.server_close()
        await loop.run_in_executor(None, self.engine.stop)
        # the KV connector's thread and client, the tensor-parallel workers
        await loop.run_in_executor(None, self.engine.core.close)


def apply_process_settings(cfg: EngineServiceConfig) -> None:
    """Pins the process, sets torch's threads and the GIL's switch interval."""
    if cfg.cpus:
        os.sched_setaffinity(0, set(cfg.cpus))
    sys.setswitchinterval(cfg.gil_switch_interval_ms * 1e-3)
    import torch

    torch.set_num_threads(cfg.num_threads)


def build_core(cfg: EngineServiceConfig):
    """Applies the process settings, loads the model, builds the KV connector when a store is
    configured; returns an EngineCore."""
    apply_process_settings(cfg)
    from pdserve.common.engine.engine_core import EngineCore  # heavy: only engine processes

    kv = cfg.kv_settings()
    return EngineCore(cfg.engine_config(),
                      connector_factory=connector_factory(kv) if kv is not None else None,
                      rank_kv=rank_kv_factory(kv) if kv is not None and kv.per_rank else None)


async def start_engine_server(cfg: EngineServiceConfig, core, tracing: Optional[Tracing] = None,
                              after_warm_up: Optional[Callable[[], object]] = None
                              ) -> RunningEngineServer:
    """`tracing`: where the servicers' spans go; None -> the process's global tracer.
    `after_warm_up`: runs on the engine thread before Health says SERVING (AsyncEngine)."""
    from pdserve.services.decode.servicer import DecodeServicer
    from pdserve.services.prefill.servicer import PrefillServicer

    budget = None
    if cfg.itl_target_ms > 0:
        budget = StepBudgetController(StepBudgetConfig(
            cfg.itl_target_ms * 1e-3, cfg.max_num_batched_tokens,
            min_tokens=min(16, cfg.max_num_batched_tokens)))
    engine = AsyncEngine(core, max_pending_outputs=cfg.max_pending_outputs,
                         step_budget=budget, step_log=step_log_from_env(),
                         after_warm_up=after_warm_up)
    engine.start(asyncio.get_running_loop())
    kv = cfg.kv_settings()
    info = InstanceInfo(model=cfg.model, role=cfg.role, max_model_len=core.max_model_len,
                        vocab_size=core.tokenizer.vocab_size, fingerprint=core.fingerprint,
                        block_size=cfg.block_size, kv_role=kv.role if kv is not None else "")
    metrics = EngineMetrics(cfg.model, stats_source=lambda: (engine.stats(), engine.kv_stats()))
    tel = EngineTelemetry(tracer=tracing.tracer if tracing is not None else None,
                          metrics=metrics, kv_store=kv is not None)
    server = grpc.aio.server(options=grpc_limits(cfg.grpc_max_message_bytes),
                             maximum_concurrent_rpcs=cfg.grpc_max_concurrent_rpcs,
                             interceptors=interceptors_for(cfg.tls.enabled, ENGINE_CALLERS))
    if cfg.role in ("unified", "prefill"):
        pb_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(engine, info, tel), server)
    if cfg.role in ("unified", "decode"):
        pb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(engine, info, tel), server)
    health = add_standard_services(server, _engine_services(cfg.role), lambda: engine.healthy)
    port = add_port(server, f"{cfg.host}:{cfg.port}", cfg.tls)
    if port == 0:
        engine.stop()
        raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
    metrics_http = None
    if cfg.metrics_port:
        try:
            metrics_http = metrics.serve_http(cfg.host, cfg.metrics_port)
        except OSError:
            engine.stop()
            raise
    await server.start()  # Health answers NOT_SERVING until the engine thread warmed up
    return RunningEngineServer(server, engine, port, metrics, metrics_http, health)


def _engine_services(role: str) -> tuple[str, ...]:
    names = {"unified": ("PrefillService", "DecodeService"), "prefill": ("PrefillService",),
             "decode": ("DecodeService",)}[role]
    return service_names(*((engine_pb2.DESCRIPTOR, n) for n in names))


async def run_engine_server(cfg: EngineServiceConfig) -> None:
    tracing = setup_tracing(f"pdserve-{cfg.role}", otlp_endpoint=cfg.otlp_endpoint or None)
    apply_process_settings(cfg)  # on this thread first: threads started later inherit the pin
    # the model load and profiling forward leave no OpenMP team behind (build_thread.py)
    core = run_on_exiting_thread(build_core, cfg)
    # the model and the warm-up's objects: full GC passes skip them; frozen before Health says
    # SERVING, so no request waits on that collection
    running = await start_engine_server(cfg, core, tracing, after_warm_up=freeze_startup_heap)
    if not await running.engine.wait_warmed_up():
        log.error("warm-up failed; the engine is not serving")
    log.info("%s engine service for %s listening on %s:%d (%s)", cfg.role, cfg.model, cfg.host,
             running.port, "mutual TLS" if cfg.tls.enabled else "plaintext")
    if cfg.metrics_port:
        log.info("Prometheus metrics on http://%s:%d/metrics", cfg.host, cfg.metrics_port)
    from pdserve.services.registry.engine_snapshot import engine_heartbeat

    heartbeat = await engine_heartbeat(cfg, running.engine, running.port)  # None: no registry
    await wait_for_signal()
    log.info("shutting down: draining for up to %.0fs", cfg.drain_timeout_s)
    if heartbeat is not None:
        await heartbeat.stop()  # leave the registry before draining: no new requests come
    running.engine.begin_drain()
    if await running.engine.drained(cfg.drain_timeout_s):
        log.info("drained: no request running, no KV save pending")
    else:
        log.warning("drain deadline passed with requests still running; they are cut off")
    await running.stop(cfg.grace_s)
    tracing.shutdown()
