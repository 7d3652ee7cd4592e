"""Real processes for the tracing tests: redis, a KV store master and node, one prefill and
one decode instance (the router is started apart, so the engine-side chain does not depend on
it), all on free loopback ports, all stopped on exit, failure included."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.services.kvstore.redis_proc import RedisProcess
from pdserve.services.launcher import Child, engine_serving, free_port, http_ok, wait_until
from pdserve.tests.integration.disagg_helpers import _store_nodes
from pdserve.tests.integration.services_helpers import SERVE, TINY_ENGINE_ARGS

HOST = "127.0.0.1"


@dataclass
class EngineStack:
    log_dir: Path
    master: str
    prefill: str
    decode: str
    prefill_metrics: int  # the instances' /metrics ports
    decode_metrics: int
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], check) -> Child:
        child = Child(name, SERVE + argv, self.log_dir)
        child.start()
        self.children.append(child)
        wait_until(check, child, 120, threading.Event())
        return child

    def start_router(self) -> tuple[str, str]:
        """A disaggregated router over the two instances; returns (http url, grpc address)."""
        hp, gp = free_port(HOST), free_port(HOST)
        url = f"http://{HOST}:{hp}"
        self.start("router", ["router", "--model", "tiny", "--backends", self.decode,
                              "--prefill-backends", self.prefill, "--kv-store", self.master,
                              "--port", str(hp), "--grpc-port", str(gp),
                              "--health-interval", "0.3"], lambda: http_ok(f"{url}/health"))
        return url, f"{HOST}:{gp}"


@contextlib.contextmanager
def engine_stack(log_dir: Path):
    log_dir.mkdir(parents=True, exist_ok=True)
    with RedisProcess() as redis:
        master = f"{HOST}:{free_port(HOST)}"
        addrs = {r: f"{HOST}:{free_port(HOST)}" for r in ("prefill", "decode")}
        stack = EngineStack(log_dir, master, addrs["prefill"], addrs["decode"],
                            free_port(HOST), free_port(HOST))
        try:
            stack.start("kv-master", ["kvstore-master", "--port", master.split(":")[1],
                                      "--redis-url", redis.url, "--node-timeout", "3"],
                        lambda: _store_nodes(master) >= 0)
            stack.start("kv-node", ["kvstore-node", "--master", master, "--capacity-mib", "64",
                                    "--transport", "tcp"], lambda: _store_nodes(master) > 0)
            for role, mport in (("prefill", stack.prefill_metrics),
                                ("decode", stack.decode_metrics)):
                addr = addrs[role]
                argv = [role, "--role", role, "--port", addr.split(":")[1], "--model", "tiny",
                        "--kv-store", master, "--kv-transport", "tcp",
                        "--metrics-port", str(mport), *TINY_ENGINE_ARGS]
                stack.start(role, argv, lambda a=addr, r=role: engine_serving(a, r))
            yield stack
        finally:
            for child in reversed(stack.children):
                child.stop(10.0)
