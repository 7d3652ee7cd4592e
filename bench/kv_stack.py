"""The processes `pdserve bench kv` measures: redis, the KV store (master + one node), one
prefill instance and two decode instances (A gets the hand-offs, B only ever sees store hits).

Lifecycle: `kv_bench_stack(...)` starts them in order, each once the previous one is ready,
and stops all of them in reverse order on exit, failure or Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path

from pdserve.services.launch_plans import SERVE, redis_ready, redis_server, store_ready
from pdserve.services.launcher import Child, engine_serving, free_port, wait_until

HOST = "127.0.0.1"


@dataclass(frozen=True)
class KVStackSpec:
    model: str = "smollm2"
    threads: int = 1  # torch threads per engine
    prefill_cpus: str = "0"
    decode_cpus: str = "1"
    max_model_len: int = 2112
    num_blocks: int = 200  # per engine: a 2,048-token prompt needs 129
    transport: str = "auto"
    capacity_mib: int = 1024
    startup_timeout_s: float = 300.0
    layer_segments: int = 1  # stored objects per block on every engine (connector/segments.py)

    def __post_init__(self):
        if min(self.threads, self.num_blocks, self.capacity_mib, self.layer_segments) < 1:
            raise ValueError("threads, num_blocks, capacity_mib and layer_segments must be >= 1")


@dataclass(frozen=True)
class KVStack:
    store: str
    prefill: str
    decode_a: str
    decode_b: str


def _start(children: list, spec: KVStackSpec, name: str, argv: list[str], ready,
           log_dir: Path) -> None:
    child = Child(name, argv, log_dir)
    child.start()
    children.append(child)
    wait_until(ready, child, spec.startup_timeout_s, threading.Event())


def _engine_argv(spec: KVStackSpec, role: str, port: int, store: str, cpus: str) -> list[str]:
    argv = SERVE + [role, "--port", str(port), "--model", spec.model, "--kv-store", store,
                    "--kv-transport", spec.transport, "--num-threads", str(spec.threads),
                    "--max-model-len", str(spec.max_model_len),
                    "--num-blocks", str(spec.num_blocks),
                    "--kv-layer-segments", str(spec.layer_segments)]
    if role == "decode":
        argv += ["--role", "decode"]
    return ["taskset", "-c", cpus] + argv if cpus else argv


@contextlib.contextmanager
def kv_bench_stack(spec: KVStackSpec, log_dir: Path):
    log_dir.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    redis_port, store_port = free_port(HOST), free_port(HOST)
    store = f"{HOST}:{store_port}"
    ports = {name: free_port(HOST) for name in ("prefill", "decode-a", "decode-b")}
    try:
        (log_dir / "redis").mkdir(exist_ok=True)
        _start(children, spec, "redis", [redis_server(), "--bind", HOST, "--port",
                                         str(redis_port), "--dir", str(log_dir / "redis"),
                                         "--save", "", "--appendonly", "no"],
               lambda: redis_ready(HOST, redis_port), log_dir)
        _start(children, spec, "kvstore", SERVE + [
            "kvstore", "--port", str(store_port), "--redis-url",
            f"redis://{HOST}:{redis_port}/0", "--capacity-mib", str(spec.capacity_mib),
            "--transport", spec.transport], lambda: store_ready(store), log_dir)
        for name, port in ports.items():
            role = "prefill" if name == "prefill" else "decode"
            cpus = spec.prefill_cpus if role == "prefill" else spec.decode_cpus
            _start(children, spec, name, _engine_argv(spec, role, port, store, cpus),
                   lambda a=f"{HOST}:{port}", r=role: engine_serving(a, r), log_dir)
        yield KVStack(store, *(f"{HOST}:{p}" for p in ports.values()))
    finally:
        for child in reversed(children):
            child.stop(10.0)
