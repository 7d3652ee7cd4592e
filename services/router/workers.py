"""Router workers: N processes serving one router's HTTP and gRPC ports (`--workers N`).

One router process runs its HTTP server, its gRPC server and all of its Python on one event
loop, so on one core. With `--workers N` (N > 1) the process started is a supervisor: it
starts N worker processes, each a whole router (tokenizer, instance health checks, registry
and DNS watchers, routing state) that binds the same HTTP and gRPC ports with SO_REUSEPORT,
so the kernel spreads incoming connections over them; it serves nothing itself, stops them
all on SIGTERM/SIGINT, and stops them all (and exits 1) when one of them dies.
`--workers 1` (the default) is the single process as before: no supervisor, no shared files.

What the workers do not share, and how each is handled:

- **Admission and connection limits** (`--max-prefilling`, `--max-queued`,
  `--max-queued-tokens`, `--rate-limit-*`, `--http-max-concurrency`,
  `--grpc-max-concurrent-rpcs`) are the stack's: each worker enforces 1/N of each (counts
  rounded up, rates divided; `per_worker`). The total holds while the kernel spreads
  connections evenly; a client whose requests all ride one keep-alive connection reaches one
  worker and gets 1/N of a per-key rate limit.
- **Metrics**: every worker writes its series to files in one directory (prometheus_client's
  multiprocess mode), and `/metrics` on any worker reads them all: counters and histograms are
  summed over the workers; gauges come once per worker with a `pid` label (sum them, e.g.
  `sum without(pid)(pdserve_router_requests_in_flight)`; the polled instance gauges are the
  same in every worker).
- **Routing state** (prefix memory, session affinity, in-flight counts per instance) is per
  worker: a worker routes by what it has seen, and the engines' load (GetLoad) is polled by
  each. Instance health checks and registry reads run N times.
- `/health` answers from whichever worker takes the connection, with its `worker` index.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from pdserve.services.router.config import RouterConfig

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it at import


def per_worker(cfg: RouterConfig) -> RouterConfig:
    """A worker's share of the limits: 1/N of each (counts rounded up, at least 1 where 0
    would mean something else; rates divided). N = 1 returns cfg unchanged."""
    n = cfg.workers
    if n == 1:
        return cfg
    a, lim = cfg.admission, cfg.limits
    admission = dataclasses.replace(
        a, max_prefilling=math.ceil(a.max_prefilling / n),
        max_queued=math.ceil(a.max_queued / n),
        max_queued_tokens=math.ceil(a.max_queued_tokens / n),
        rate_limit_rps=a.rate_limit_rps / n,
        # an explicit burst is split too, but a worker can always take one request
        rate_limit_burst=max(1.0, a.rate_limit_burst / n) if a.rate_limit_burst else 0.0,
        rate_limit_tokens_per_s=a.rate_limit_tokens_per_s / n)
    limits = dataclasses.replace(
        lim, http_max_concurrency=math.ceil(lim.http_max_concurrency / n),
        grpc_max_concurrent_rpcs=math.ceil(lim.grpc_max_concurrent_rpcs / n))
    return dataclasses.replace(cfg, admission=admission, limits=limits)


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT (not yet listening): every worker
    binds one, and the kernel spreads connections over the listening ones."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _free_port(host: str) -> int:
    with reuseport_socket(host, 0) as s:
        return s.getsockname()[1]


def worker_argv(argv: list[str], index: int, port: int, grpc_port: int) -> list[str]:
    """The command words of worker `index`: the supervisor's own words (`serve router ...`)
    with the resolved ports and the worker's index appended (argparse: the last one wins)."""
    return [*argv, "--port", str(port), "--grpc-port", str(grpc_port),
            "--worker-index", str(index)]


def run_supervisor(cfg: RouterConfig, argv: list[str], poll_s: float = 0.2) -> int:
    """Start cfg.workers workers (the words `argv` that started this process, plus each
    one's index), wait for SIGTERM/SIGINT or a worker's exit, stop them all. Returns 0 after a
    signal, 1 when a worker died first."""
    from pdserve.services.launcher import PARENT_ENV

    port = cfg.port or _free_port(cfg.host)  # every worker must bind the same port
    grpc_port = cfg.grpc_port if cfg.grpc_port != 0 else _free_port(cfg.host)
    metrics_dir = tempfile.mkdtemp(prefix="pdserve-router-metrics-")
    env = dict(os.environ, **{PARENT_ENV: str(os.getpid()), MULTIPROC_ENV: metrics_dir})
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    procs = []
    try:
        for i in range(cfg.workers):
            words = worker_argv(argv, i, port, grpc_port)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pdserve.services.exec_tied", sys.executable, "-m",
                 "pdserve.services.cli_serve", *words], env=env, stdin=subprocess.DEVNULL))
        print(f"router: {cfg.workers} workers on http {cfg.host}:{port}, grpc {grpc_port} "
              f"(pids {' '.join(str(p.pid) for p in procs)})", flush=True)
        while not stop and all(p.poll() is None for p in procs):
            time.sleep(poll_s)
        return 0 if stop else 1
    finally:
        _stop_all(procs, cfg.grace_s + 10)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _stop_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def worker_metrics():
    """A worker's RouterMetrics whose /metrics reads every worker's series (the directory
    the supervisor set in MULTIPROC_ENV before this process imported prometheus_client)."""
    from prometheus_client import CollectorRegistry, generate_latest, values
    from prometheus_client.multiprocess import MultiProcessCollector

    from pdserve.common.telemetry.metrics import RouterMetrics

    directory = os.environ.get(MULTIPROC_ENV, "")
    if not directory or values.ValueClass is values.MutexValue:
        raise RuntimeError(f"a router worker needs {MULTIPROC_ENV} set before start (its "
                           f"supervisor sets it): run `serve router --workers N` without "
                           f"--worker-index")

    class _WorkerMetrics(RouterMetrics):
        def __init__(self):
            super().__init__()
            self._all = CollectorRegistry()
            MultiProcessCollector(self._all, path=directory)

        def render(self) -> bytes:
            return generate_latest(self._all)

    return _WorkerMetrics()
