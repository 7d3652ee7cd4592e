"""Bringing up a whole stack with `pdserve up` as a subprocess, for compare and tests.

The launcher stops its own children on SIGTERM (and they die with it), so stopping the stack is
SIGTERM to the launcher, a grace period, then SIGKILL to its process group.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

UP = (sys.executable, "-m", "pdserve.cli", "up")


class StackUnavailable(RuntimeError):
    """`pdserve up` refused the mode or its options, or the stack never became healthy."""


@dataclass(frozen=True)
class StackSpec:
    mode: str  # colocated | disagg
    model: str = "smollm2"
    extra_args: tuple[str, ...] = ()  # pinning and thread counts, passed to `pdserve up`
    startup_timeout_s: float = 300.0

    def __post_init__(self):
        if self.mode not in ("colocated", "disagg"):
            raise ValueError(f"mode must be colocated or disagg, got {self.mode!r}")
        if not self.startup_timeout_s > 0:
            raise ValueError("startup_timeout_s must be > 0")


@dataclass(frozen=True)
class RunningStack:
    http_url: str
    grpc_addr: str
    log_dir: Path
    tls_dir: str = ""  # the stack's certificates (its gRPC clients use the client one)


def check_up_accepts(spec: StackSpec) -> None:
    """Fails fast (before any sweep runs) when `pdserve up` refuses this mode or these options.
    The command line is parsed here with pdserve's own parser, not run: `up --help` would not
    do, since argparse reports unknown options only after a full parse."""
    from pdserve.cli import build_parser

    argv = ["up", "--mode", spec.mode, "--model", spec.model, *spec.extra_args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            tail = err.getvalue().strip().splitlines()[-1:] or ["(no message)"]
            raise StackUnavailable(
                f"`pdserve up --mode {spec.mode} {' '.join(spec.extra_args)}` is refused: "
                f"{tail[0]}. The {spec.mode} stack (services/cli_serve.py `up`, "
                f"services/launcher.py) does not offer this yet.") from None


def _healthy(url: str) -> bool:
    from pdserve.services.launcher import http_ok

    return http_ok(url)


@contextlib.contextmanager
def running_stack(spec: StackSpec, log_dir: Path):
    from pdserve.services.launcher import free_port

    log_dir.mkdir(parents=True, exist_ok=True)
    hp, gp = free_port("127.0.0.1"), free_port("127.0.0.1")
    tls = "" if "--insecure" in spec.extra_args else str(log_dir / "tls")
    if tls:  # `up`'s mutual TLS with certificates the bench's gRPC client can use too
        from pdserve.services.common.certs import make_certs

        make_certs(tls)
    argv = [*UP, "--mode", spec.mode, "--model", spec.model, "--port", str(hp),
                 "--grpc-port", str(gp), "--log-dir", str(log_dir), *spec.extra_args]
    argv += ["--tls-dir", tls] if tls else []
    log = open(log_dir / "up.log", "ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{hp}/health", spec, log_dir)
        yield RunningStack(f"http://127.0.0.1:{hp}", f"127.0.0.1:{gp}", log_dir, tls)
    finally:
        _stop(proc)
        log.close()


def _wait_healthy(proc: subprocess.Popen, url: str, spec: StackSpec, log_dir: Path) -> None:
    deadline = time.monotonic() + spec.startup_timeout_s
    while not _healthy(url):
        if proc.poll() is not None:
            tail = (log_dir / "up.log").read_text(errors="replace").splitlines()[-15:]
            raise StackUnavailable(f"`pdserve up --mode {spec.mode}` exited with "
                                   f"{proc.returncode}; its log ends:\n" + "\n".join(tail))
        if time.monotonic() > deadline:
            raise StackUnavailable(f"{spec.mode} stack not healthy after "
                                   f"{spec.startup_timeout_s:.0f}s; logs in {log_dir}")
        time.sleep(0.3)


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything of the stack still left
    proc.wait()
