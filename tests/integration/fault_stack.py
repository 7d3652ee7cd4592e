"""A disaggregated stack for the fault matrix (tests/integration/test_fault_matrix.py): Redis,
the KV store master and one storage node (separate processes, so each can fail alone), one
prefill and two decode instances, and the router, which reaches each decode instance through a
`LinkProxy` (so a test can cut the router-to-engine link). Every process is a launcher `Child`
(the same mechanism `pdserve up` and disagg_helpers use) on a fixed port, so `revive(name)`
starts a killed one again with its command line and it comes back where it was.

Lifecycle: `fault_stack(log_dir)` starts everything in dependency order and waits for each to be
ready -> the test injects faults (`pid(name)`, `LinkProxy.cut()`) and revives what it broke ->
on exit every stopped process is continued and every process is stopped, failure included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pdserve.services.launch_plans import redis_ready
from pdserve.services.launcher import Child, engine_serving, free_port, http_ok, wait_until
from pdserve.tests.integration.disagg_helpers import _store_nodes, store_node_addresses
from pdserve.tests.integration.services_helpers import SERVE, TINY_ENGINE_ARGS
from pdserve.tests.integration.tcp_queues import listening_endpoints

HOST = "127.0.0.1"


class LinkProxy:
    """A TCP relay HOST:port -> target. `cut()` blackholes it: bytes on open connections are
    dropped (nothing is closed, as in a network partition) and new connections are accepted
    and never answered. `heal()` closes what was open while cut and relays again."""

    def __init__(self, target: str):
        self.target = target
        self._srv = socket.create_server((HOST, 0))
        self.address = f"{HOST}:{self._srv.getsockname()[1]}"
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._cut.set()

    def heal(self) -> None:
        self._cut.clear()
        self._close_all()

    def close(self) -> None:
        self._srv.close()
        self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            with self._lock:
                self._socks.append(conn)
            if self._cut.is_set():
                continue  # accepted, never answered
            host, port = self.target.rsplit(":", 1)
            try:
                up = socket.create_connection((host, int(port)), timeout=2)
            except OSError:
                conn.close()
                continue
            up.settimeout(None)
            with self._lock:
                self._socks.append(up)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self._cut.is_set():  # cut: the bytes are lost on the way
                    dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@dataclass
class FaultStack:
    http_url: str
    master: str  # the KV store master's address
    prefill: str  # the prefill instance's address (the router reaches it directly)
    log_dir: Path
    children: dict[str, Child] = field(default_factory=dict)
    ready: dict[str, Callable[[], bool]] = field(default_factory=dict)
    proxies: dict[str, LinkProxy] = field(default_factory=dict)  # decode name -> its relay

    def pid(self, name: str) -> int:
        return self.children[name].proc.pid

    def revive(self, name: str, timeout_s: float = 120.0) -> None:
        """Continues a stopped process or starts a dead one again; waits until it is ready."""
        child = self.children[name]
        if child.alive:
            os.kill(child.proc.pid, signal.SIGCONT)
        else:
            child.start()
        wait_until(self.ready[name], child, timeout_s, threading.Event())

    def _start(self, name: str, argv: list[str], ready: Callable[[], bool],
               wait: bool = True) -> None:
        child = Child(name, argv, self.log_dir)
        child.start()
        self.children[name], self.ready[name] = child, ready
        if wait:
            self._wait(name)

    def _wait(self, name: str) -> None:
        wait_until(self.ready[name], self.children[name], 120, threading.Event())

    def stop_all(self) -> None:
        for child in reversed(list(self.children.values())):
            if child.alive:
                os.kill(child.proc.pid, signal.SIGCONT)  # a stopped process cannot exit
            child.stop(10.0)
        for proxy in self.proxies.values():
            proxy.close()


def _node_registered(master: str, pid: int) -> bool:
    """The master lists the node that process `pid` serves, and no other (the stack has one
    node). Not just "the master lists a node": after a SIGKILL the master keeps the dead node
    until its heartbeats time out, so a restart looked ready at once, and the next fault case
    froze a node still booting, which no put reached (a flake seen under load)."""
    ports = {e.rsplit(":", 1)[1] for e in listening_endpoints(pid)}
    listed = store_node_addresses(master) or ()
    return bool(listed) and all(a.rsplit(":", 1)[1] in ports for a in listed)


def _ports(n: int) -> list[int]:
    return [free_port(HOST) for _ in range(n)]


@contextlib.contextmanager
def fault_stack(log_dir: Path, router_args=(), engine_args=TINY_ENGINE_ARGS):
    log_dir.mkdir(parents=True, exist_ok=True)
    rp, mp, hp, gp, pp, d0, d1 = _ports(7)
    stack = FaultStack(f"http://{HOST}:{hp}", f"{HOST}:{mp}", f"{HOST}:{pp}", log_dir)
    master = stack.master
    try:
        redis_dir = log_dir / "redis"
        redis_dir.mkdir(exist_ok=True)
        stack._start("redis", [shutil.which("redis-server"), "--bind", HOST, "--port", str(rp),
                               "--dir", str(redis_dir), "--save", "", "--appendonly", "no"],
                     lambda: redis_ready(HOST, rp))
        stack._start("kv-master", SERVE + [
            "kvstore-master", "--port", str(mp), "--redis-url", f"redis://{HOST}:{rp}/0",
            "--node-timeout", "3"], lambda: _store_nodes(master) >= 0)
        stack._start("kv-node", SERVE + ["kvstore-node", "--master", master, "--capacity-mib",
                                         "64", "--transport", "tcp"],
                     lambda: _node_registered(master, stack.pid("kv-node")))
        kv = ["--kv-store", master, "--kv-transport", "tcp", "--model", "tiny", *engine_args]
        engines = (("prefill0", "prefill", pp), ("decode0", "decode", d0),
                   ("decode1", "decode", d1))
        for name, role, port in engines:
            addr = f"{HOST}:{port}"
            argv = SERVE + [role, "--port", str(port), *kv]
            if role == "decode":
                argv += ["--role", "decode"]
                stack.proxies[name] = LinkProxy(addr)
            stack._start(name, argv, lambda a=addr, r=role: engine_serving(a, r), wait=False)
        for name, _, _ in engines:  # they boot together: startup is mostly imports and loading
            stack._wait(name)
        backends = ",".join(stack.proxies[n].address for n in ("decode0", "decode1"))
        stack._start("router", SERVE + [
            "router", "--model", "tiny", "--backends", backends, "--prefill-backends",
            stack.prefill, "--kv-store", master, "--port", str(hp), "--grpc-port", str(gp),
            "--health-interval", "0.3", *router_args],
            lambda: http_ok(f"{stack.http_url}/health"))
        yield stack
    finally:
        stack.stop_all()
