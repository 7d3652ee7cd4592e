"""`pdserve up`: the whole stack on this machine, each service its own child process.

Lifecycle: make the log folder -> start the services of the plan in order
(services/launch_plans.py: redis for the instance registry, then per mode the KV store,
prefill and decode instances, or unified replicas, then the router), each after the previous
one is ready, printing each one's state and the KV budget each engine chose -> print the map
of what runs where and the endpoints -> supervise (services/supervisor.py): a service that
exits is restarted with backoff and re-registers, the rest keeps serving -> on SIGINT/SIGTERM
stop in reverse order (router first, so no new work reaches the engines): SIGTERM,
`stop_timeout_s` to exit (engines drain their streams meanwhile), then SIGKILL. The kernel
sends every child SIGTERM when the launcher dies (PR_SET_PDEATHSIG: every child starts
through the `exec_tied` trampoline, which sets it and execs the service, ours or not), so even
a killed launcher leaves no orphans. Children are started without a `preexec_fn`, so
subprocess can vfork: fork() in a process with gRPC / OpenMP threads runs their atfork
handlers, which can deadlock the parent or break the child (see exec_tied.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from pdserve.services.common.tls_args import RunSecrets
from pdserve.services.ports import free_port  # noqa: F401  (re-exported for plans and tests)

PARENT_ENV = "PDSERVE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child of the launcher (exec_tied calls it before exec): get SIGTERM when the
    launcher exits (Linux only)."""
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
        argv = [sys.executable, "-m", "pdserve.services.exec_tied", *self.argv]  # tied to us
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
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


def engine_serving(address: str, service: str = "decode", tls_dir: str = "") -> bool:
    """True when the instance's Health (on DecodeService, or PrefillService for a prefill
    instance) says SERVING; `tls_dir`: ask over mutual TLS with its client certificate."""
    import grpc

    from pdserve.common.rpc import engine_pb2 as pb
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
    from pdserve.services.common.tls import TlsConfig, open_channel

    stub = pb_grpc.PrefillServiceStub if service == "prefill" else pb_grpc.DecodeServiceStub
    tls = TlsConfig.from_dir(tls_dir, "client") if tls_dir else TlsConfig()
    role = "prefill" if service == "prefill" else "decode"
    with open_channel(address, tls, role, aio=False) as channel:
        try:
            health = stub(channel).Health(pb.HealthRequest(), timeout=1.0)
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


@dataclass(frozen=True)
class Step:
    """One service of a stack: its process and the check that says it is ready."""

    child: Child
    ready: Callable[[], bool]
    describe: Optional[Callable[[], str]] = None  # a line once ready (an engine's KV budget)


def engine_kv_budget(address: str, service: str = "decode", tls_dir: str = "") -> str:
    """The KV cache the instance sized for itself, as one line for the terminal; `tls_dir`:
    ask over mutual TLS with its client certificate."""
    from pdserve.common.rpc import engine_pb2 as pb
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
    from pdserve.services.common.tls import TlsConfig, open_channel

    stub = pb_grpc.PrefillServiceStub if service == "prefill" else pb_grpc.DecodeServiceStub
    tls = TlsConfig.from_dir(tls_dir, "client") if tls_dir else TlsConfig()
    with open_channel(address, tls, service, aio=False) as channel:
        s = stub(channel)
        health = s.Health(pb.HealthRequest(), timeout=2.0)
        load = s.GetLoad(pb.LoadRequest(), timeout=2.0)
    blocks, size = load.num_total_blocks, health.block_size
    return f"KV cache {blocks} blocks x {size} tokens = {blocks * size} tokens"


def run_up(args, stop_timeout_s: float = 30.0) -> int:
    from pdserve.services.launch_plans import plan_stack
    from pdserve.services.supervisor import Supervisor

    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"pdserve up ({args.mode}, model {args.model}); logs in {log_dir}", flush=True)
    code, sup = 0, None
    # mutual TLS unless --insecure (a fresh CA, or --tls-dir's); Redis's password
    secrets = RunSecrets(args.insecure, args.tls_dir)
    try:
        plan = plan_stack(args, log_dir, secrets.tls_dir, secrets.dir)
        print(plan.layout, flush=True)
        sup = Supervisor(plan.steps, startup_timeout_s=args.startup_timeout)
        sup.start_all(stop)
        print(plan.endpoints + f"\n  logs          {log_dir}\nready; Ctrl-C to stop", flush=True)
        sup.watch(stop)
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for child in reversed(sup.started if sup is not None else []):
            child.stop(stop_timeout_s)  # the router first: no new work reaches the rest
        secrets.close()  # the run's keys and password go with it
    print("pdserve up: stopped", flush=True)
    return code
