"""A tiny unified engine and a router in this process, on an event loop of their own thread, so
blocking clients (and asyncio clients on other loops) can call them from the test's thread.

Starting them here costs one model build and no process start (each pdserve process imports
torch, which is slow on a loaded machine)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class InprocStack:
    engine_addr: str
    router_grpc: str
    router_http: str  # http://127.0.0.1:PORT


@contextlib.contextmanager
def inproc_stack(max_model_len: int = 256) -> Iterator[InprocStack]:
    from pdserve.services.engine_host.engine_server import build_core, start_engine_server
    from pdserve.services.launcher import http_ok
    from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.router.server import start_router

    cfg = EngineServiceConfig(role="unified", port=0, model="tiny", num_blocks=64,
                              max_model_len=max_model_len)
    core = build_core(cfg)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="inproc-stack", daemon=True)
    thread.start()

    def run(coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    engine = router = None
    try:
        engine = run(start_engine_server(cfg, core))
        assert run(engine.engine.wait_warmed_up(), 120)  # SERVING only after its warm-up
        eaddr = f"127.0.0.1:{engine.port}"
        router = run(start_router(RouterConfig(model="tiny", backends=(eaddr,), port=0,
                                               grpc_port=0, health_interval_s=0.2)))
        deadline = time.monotonic() + 60  # until the router has seen the engine SERVING
        while not http_ok(f"http://127.0.0.1:{router.http_port}/health"):
            assert time.monotonic() < deadline, "the router never saw the engine SERVING"
            time.sleep(0.1)
        yield InprocStack(eaddr, f"127.0.0.1:{router.grpc_port}",
                          f"http://127.0.0.1:{router.http_port}")
    finally:
        if router is not None:
            run(router.stop())
        if engine is not None:
            run(engine.stop(0.5))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
