"""A private redis-server for tests and the local launcher.

Lifecycle: `RedisProcess.start()` runs `redis-server` on a free loopback port with its files
in a fresh temp dir, no persistence to disk beyond that dir, and waits until it answers PING;
`stop()` terminates it (kills it after a grace period) and removes the dir. It is a context
manager too. scripts/ensure_redis.sh installs redis-server where it is missing.

With `password_file`, redis requires that password (`requirepass`): it goes into a config file
(mode 0600) in the private dir, never into redis-server's argv; `url` then carries it, so
write it to a file for the master (`--redis-url-file`) rather than passing it on a command line.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from urllib.parse import quote

from pdserve.services.ports import free_port  # noqa: F401  (callers import it from here too)
import time


class RedisUnavailable(RuntimeError):
    """redis-server is not installed or did not come up."""


class RedisProcess:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, binary: str = "redis-server",
                 password_file: str = ""):
        self.host = host
        self.port = port
        self._binary = binary
        self._password = _read_password(password_file) if password_file else ""
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        """The URL to connect with (the password in it when there is one)."""
        auth = f":{quote(self._password, safe='')}@" if self._password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisProcess":
        exe = shutil.which(self._binary)
        if exe is None:
            raise RedisUnavailable("redis-server not found: run scripts/ensure_redis.sh")
        self.port = self.port or free_port(self.host)
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        conf = os.path.join(self._dir, "redis.conf")
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            if self._password:
                f.write(f'requirepass "{self._password}"\n')
        self._proc = subprocess.Popen(
            [exe, conf, "--bind", self.host, "--port", str(self.port), "--dir", self._dir,
             "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RedisUnavailable(f"redis-server exited with {self._proc.returncode}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                    if self._password:
                        pw = self._password.encode()
                        s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                        if not s.recv(16).startswith(b"+OK"):
                            raise RedisUnavailable("redis-server refused its password")
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RedisUnavailable(f"redis-server did not answer within {timeout_s} s")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "RedisProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _read_password(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        pw = f.read(1024).strip()
    if not pw or any(c in pw for c in '"\\\n\r ') or not pw.isprintable():
        raise ValueError(f"{path}: the redis password must be printable, without quotes, "
                         "backslashes or spaces")
    return pw
