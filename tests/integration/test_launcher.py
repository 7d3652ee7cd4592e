"""`pdserve up` starts every service, serves, and stops cleanly: no process is left behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.services.launcher import free_port


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its exit status waits to be read


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def start_up(tmp_path: Path):
    port, gport = free_port("127.0.0.1"), free_port("127.0.0.1")
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", "tiny", "--port", str(port),
         "--grpc-port", str(gport), "--log-dir", str(log_dir), "--num-blocks", "64",
         "--max-model-len", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("ready"):
            return proc, port, log_dir, "".join(lines)
    proc.kill()
    raise AssertionError("pdserve up never got ready:\n" + "".join(lines))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_serves_then_stops_cleanly(tmp_path, sig):
    proc, port, log_dir, banner = start_up(tmp_path)
    try:
        kids = children_of(proc.pid)
        assert len(kids) == 2  # the unified engine and the router
        assert f"http://127.0.0.1:{port}/v1" in banner and str(log_dir) in banner
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "tiny", "prompt": "up", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        proc.send_signal(sig)
        assert proc.wait(30) == 0
        assert "stopped" in proc.stdout.read()
        assert wait_gone(kids, 5) == []
        logs = {p.name: p.read_text() for p in log_dir.iterdir()}
        assert set(logs) == {"engine-unified.log", "router.log"}
        assert "shutting down" in logs["router.log"] and "shutting down" in logs[
            "engine-unified.log"]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_launcher_leaves_no_orphans(tmp_path):
    proc, _, _, _ = start_up(tmp_path)
    kids = children_of(proc.pid)
    assert len(kids) == 2
    proc.kill()  # no chance to clean up: the children must notice on their own
    proc.wait()
    left = wait_gone(kids, 15)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []
