"""Starting real service processes for integration tests: free ports, health waits, cleanup.

`tiny_stack()` starts a unified engine (the tiny model unless told otherwise) and a router as
two processes, waits until both are healthy, and stops both on exit, failure included.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from pdserve.services.launcher import Child, engine_serving, free_port, http_ok, wait_until

SERVE = [sys.executable, "-m", "pdserve.services.cli_serve", "serve"]
TINY_ENGINE_ARGS = ("--num-threads", "1", "--num-blocks", "128", "--block-size", "16",
                    "--max-model-len", "512")


@dataclass(frozen=True)
class Stack:
    http_url: str  # http://127.0.0.1:PORT
    grpc_addr: str  # the router's gRPC API
    engine_addr: str  # the unified engine's gRPC services
    log_dir: Path


def start_engine(log_dir: Path, port: int, extra=TINY_ENGINE_ARGS, name="engine",
                 model="tiny") -> Child:
    child = Child(name, SERVE + ["decode", "--role", "unified", "--model", model,
                                 "--port", str(port), *extra], log_dir)
    child.start()
    return child


def start_router(log_dir: Path, backends: list[str], http_port: int, grpc_port: int,
                 extra=(), model="tiny") -> Child:
    child = Child("router", SERVE + ["router", "--model", model, "--backends",
                                     ",".join(backends), "--port", str(http_port),
                                     "--grpc-port", str(grpc_port), "--health-interval", "0.3",
                                     *extra], log_dir)
    child.start()
    return child


def wait_engine(child: Child, address: str, timeout_s: float = 60.0) -> None:
    wait_until(lambda: engine_serving(address), child, timeout_s, threading.Event())


def wait_http(child: Child, url: str, timeout_s: float = 60.0) -> None:
    wait_until(lambda: http_ok(url), child, timeout_s, threading.Event())


@contextlib.contextmanager
def tiny_stack(log_dir: Path, engine_extra=TINY_ENGINE_ARGS, model="tiny"):
    log_dir.mkdir(parents=True, exist_ok=True)
    ep, hp, gp = free_port("127.0.0.1"), free_port("127.0.0.1"), free_port("127.0.0.1")
    engine_addr = f"127.0.0.1:{ep}"
    children = []
    try:
        children.append(start_engine(log_dir, ep, engine_extra, model=model))
        wait_engine(children[0], engine_addr, timeout_s=180)
        children.append(start_router(log_dir, [engine_addr], hp, gp, model=model))
        wait_http(children[1], f"http://127.0.0.1:{hp}/health")
        yield Stack(f"http://127.0.0.1:{hp}", f"127.0.0.1:{gp}", engine_addr, log_dir)
    finally:
        for child in reversed(children):
            child.stop(10.0)


def engine_load(address: str):
    import grpc

    from pdserve.common.rpc import engine_pb2 as pb
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.DecodeServiceStub(channel).GetLoad(pb.LoadRequest(), timeout=5)


def wait_pool_whole(address: str, timeout_s: float = 10.0):
    """Polls the engine until nothing runs or waits and every block is free; returns the load."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        load = engine_load(address)
        whole = (load.num_running == 0 and load.num_waiting == 0
                 and load.num_free_blocks == load.num_total_blocks)
        if whole or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def offline_engine(model: str = "tiny", num_blocks: int = 128):
    """The engine the services run (the tiny one unless told otherwise), in this process, for
    reference outputs."""
    import torch

    from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.common.engine.llm import LLM

    torch.set_num_threads(1)
    return LLM(EngineConfig(model=model, cache=CacheConfig(num_blocks=num_blocks, block_size=16),
                            scheduler=SchedulerConfig(max_model_len=512), num_threads=1))
