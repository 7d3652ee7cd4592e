"""`pdserve up`: the whole stack on this machine, each service its own child process.

Lifecycle: make the log folder -> start the engine instance, wait until its gRPC Health says
SERVING -> start the router, wait until its /health answers 200 -> print the endpoints -> wait
for SIGINT/SIGTERM or any child exiting -> stop in reverse order (router first, so no new work
reaches the engines): SIGTERM, `stop_timeout_s` to exit, then SIGKILL. Each child also asks the
kernel for SIGTERM when the launcher dies (see `die_with_parent`), so even a killed launcher
leaves no orphans.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional

PARENT_ENV = "PDSERVE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child of the launcher: get SIGTERM when the launcher exits (Linux only)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class Child:
    """One service process; its stdout and stderr go to `<log_dir>/<name>.log`."""

    def __init__(self, name: str, argv: list[str], log_dir: Path):
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float) -> None:
        if not self.alive:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_serving(address: str) -> bool:
    import grpc

    from pdserve.common.rpc import engine_pb2 as pb
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            health = pb_grpc.DecodeServiceStub(channel).Health(pb.HealthRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return health.status == pb.HealthResponse.SERVING


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_until(check: Callable[[], bool], child: Child, timeout_s: float,
               stop: threading.Event) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if not child.alive:
            raise RuntimeError(f"{child.name} exited during startup; its log ends:\n"
                               f"{child.log_tail()}")
        if stop.is_set():
            raise KeyboardInterrupt
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} not healthy after {timeout_s:.0f}s; see "
                               f"{child.log_path}")
        time.sleep(0.2)


def run_up(args, stop_timeout_s: float = 10.0) -> int:
    from pdserve.services.cli_serve import engine_argv

    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    engine_port = args.engine_port or free_port(args.host)
    engine_addr = f"{args.host}:{engine_port}"
    serve = [sys.executable, "-m", "pdserve.services.cli_serve", "serve"]
    engine = Child("engine-unified", serve + [
        "decode", "--role", "unified", "--host", args.host, "--port", str(engine_port),
        "--model", args.model] + engine_argv(args), log_dir)
    router = Child("router", serve + [
        "router", "--model", args.model, "--backends", engine_addr, "--host", args.host,
        "--port", str(args.port), "--grpc-port", str(args.grpc_port)], log_dir)
    children = [engine, router]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"pdserve up ({args.mode}, model {args.model}); logs in {log_dir}", flush=True)
    code = 0
    try:
        engine.start()
        wait_until(lambda: engine_serving(engine_addr), engine, args.startup_timeout, stop)
        router.start()
        health = f"http://{args.host}:{args.port}/health"
        wait_until(lambda: http_ok(health), router, args.startup_timeout, stop)
        _print_endpoints(args, engine_addr, log_dir)
        while not stop.wait(0.5):
            dead = [c for c in children if not c.alive]
            if dead:
                print(f"{dead[0].name} exited (code {dead[0].proc.returncode}); stopping. "
                      f"Its log ends:\n{dead[0].log_tail()}", file=sys.stderr, flush=True)
                code = 1
                break
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for child in reversed(children):
            child.stop(stop_timeout_s)
    print("pdserve up: stopped", flush=True)
    return code


def _print_endpoints(args, engine_addr: str, log_dir: Path) -> None:
    base = f"http://{args.host}:{args.port}"
    print(f"  OpenAI API    {base}/v1  (completions, chat/completions, models)\n"
          f"  health        {base}/health\n"
          f"  metrics       {base}/metrics\n"
          f"  router gRPC   {args.host}:{args.grpc_port}  (pdserve.v1.Router/Generate)\n"
          f"  engine gRPC   {engine_addr}  (unified)\n"
          f"  logs          {log_dir}\n"
          "ready; Ctrl-C to stop", flush=True)
