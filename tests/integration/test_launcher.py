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


def start_up(tmp_path: Path, *extra: str):
    port, gport = free_port("127.0.0.1"), free_port("127.0.0.1")
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", "tiny", "--port", str(port),
         "--grpc-port", str(gport), "--log-dir", str(log_dir), "--num-blocks", "64",
         "--max-model-len", "256", *extra],
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
        assert len(kids) == 3  # redis (the registry), the unified engine and the router
        assert f"http://127.0.0.1:{port}/v1" in banner and str(log_dir) in banner
        assert "unified0     ready in" in banner and "KV cache 64 blocks x 16 tokens" in banner
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "tiny", "prompt": "up", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        proc.send_signal(sig)
        assert proc.wait(30) == 0
        assert "stopped" in proc.stdout.read()
        assert wait_gone(kids, 5) == []
        logs = {p.name: p.read_text() for p in log_dir.glob("*.log")}
        assert set(logs) == {"redis.log", "unified0.log", "router.log"}
        assert "shutting down" in logs["router.log"] and "shutting down" in logs[
            "unified0.log"]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_launcher_leaves_no_orphans(tmp_path):
    proc, _, _, _ = start_up(tmp_path, "--discovery", "static")
    kids = children_of(proc.pid)
    assert len(kids) == 2  # static discovery: no redis
    proc.kill()  # no chance to clean up: the children must notice on their own
    proc.wait()
    left = wait_gone(kids, 15)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


DISAGG = ("--mode", "disagg", "--prefill-cpus", "0", "--prefill-threads", "1",
          "--decode-cpus", "1", "--decode-threads", "1", "--kv-transport", "tcp",
          "--kv-capacity-mib", "32")


def cpus_of(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(ln.split()[1] for ln in status.splitlines()
                if ln.startswith("Cpus_allowed_list"))


def test_up_disagg_serves_then_stops_cleanly(tmp_path):
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs cores 0 and 1")
    proc, port, log_dir, banner = start_up(tmp_path, *DISAGG)
    try:
        kids = children_of(proc.pid)
        assert len(kids) == 5  # redis, kv store, prefill, decode, router
        assert "prefill0" in banner and "KV store" in banner and "decode0" in banner
        prompt = list(range(40, 100))  # 3 full blocks: the prefill path, then a store hit
        outs = [httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 5,
                                 "temperature": 0}, timeout=60) for _ in range(2)]
        assert [r.status_code for r in outs] == [200, 200]
        assert outs[0].json()["choices"][0]["text"] == outs[1].json()["choices"][0]["text"]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'pdserve_router_prefill_skipped_total{reason="stored"} 1.0' in metrics
        by_log = {p.name: p for p in log_dir.glob("*.log")}
        assert set(by_log) == {"redis.log", "kvstore.log", "prefill0.log", "decode0.log",
                               "router.log"}
        pins = {cpus_of(k) for k in kids}
        assert {"0", "1"} <= pins  # prefill on core 0, decode on core 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_gone(kids, 5) == []
        for name in ("prefill0.log", "decode0.log", "router.log"):
            assert "shutting down" in by_log[name].read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_disagg_launcher_leaves_no_orphans(tmp_path):
    proc, _, _, _ = start_up(tmp_path, "--mode", "disagg", "--kv-transport", "tcp",
                             "--kv-capacity-mib", "32")
    kids = children_of(proc.pid)
    assert len(kids) == 5
    proc.kill()  # redis is not ours: only the kernel's parent-death signal stops it
    proc.wait()
    left = wait_gone(kids, 15)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []
