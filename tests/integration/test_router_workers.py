"""`serve router --workers 2`: a supervisor and two router processes sharing the HTTP port
(SO_REUSEPORT) over an instant fake instance; both answer, /metrics sums their counters, each
enforces its share of the limits, and SIGTERM stops all of them
(services/router/workers.py)."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import httpx
from pdserve.bench.router_fakes import FakeInstance
from pdserve.services.launcher import free_port


async def _health(port: int) -> dict:
    # a new connection per call: SO_REUSEPORT spreads connections, not requests
    async with httpx.AsyncClient(timeout=5) as http:
        r = await http.get(f"http://127.0.0.1:{port}/health")
        return r.json() if r.status_code == 200 else {}


async def _start(fake: FakeInstance, port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.services.cli_serve", "serve", "router", "--model", "tiny",
         "--backends", fake.address, "--port", str(port), "--grpc-port", "0",
         "--health-interval", "0.3", "--workers", "2", *extra],
        env=env, stdin=subprocess.DEVNULL)
    seen = set()
    for _ in range(600):  # both workers listening (each loads a tokenizer first)
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}")
        try:
            seen.add((await _health(port)).get("worker"))
        except httpx.HTTPError:
            pass
        if {0, 1} <= seen:
            return proc
        await asyncio.sleep(0.1)
    proc.terminate()
    raise RuntimeError(f"workers seen: {seen}")


@contextlib.asynccontextmanager
async def _router(tokens: int, *extra: str):
    """A fake instance streaming `tokens` per request, and `serve router --workers 2` over
    it; yields (HTTP port, the supervisor's process); stops both at the end."""
    fake = await FakeInstance.start(tokens=tokens, model="tiny")
    proc = None
    try:
        port = free_port("127.0.0.1")
        proc = await _start(fake, port, *extra)
        yield port, proc
    finally:
        if proc is not None and proc.poll() is None:
            _stop(proc)
        await fake.stop()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


async def _complete(port: int) -> int:
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"http://127.0.0.1:{port}/v1/completions",
                            json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3})
        return r.status_code


def _counter(text: str, name: str, labels: str) -> float:
    head = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(head):
            return float(line.split()[-1])
    return 0.0


def test_two_workers_answer_and_metrics_sum_over_them():
    asyncio.run(asyncio.wait_for(_two_workers(), 120))


async def _two_workers():
    async with _router(3) as (port, proc):
        workers = _children(proc.pid)
        assert len(workers) == 2  # the supervisor serves nothing itself
        statuses = await asyncio.gather(*(_complete(port) for _ in range(12)))
        assert statuses == [200] * 12
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        # whichever worker answered the scrape, it counts every worker's requests
        assert _counter(text, "pdserve_requests_total",
                        'endpoint="/v1/completions",status="200"') == 12.0
        assert _counter(text, "pdserve_generation_tokens_total", "") == 36.0
        # gauges: one series per worker, labelled by pid (documented)
        pids = {int(line.split('pid="')[1].split('"')[0]) for line in text.splitlines()
                if line.startswith("pdserve_router_requests_in_flight{")}
        assert len(pids) == 2
        assert _stop(proc) == 0
    for pid in workers:  # SIGTERM to the supervisor ended every worker
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_each_worker_enforces_its_share_of_a_rate_limit():
    asyncio.run(asyncio.wait_for(_rate_share(), 120))


async def _rate_share():
    # a burst of 2 for the stack (refilled at 0.01/s): each worker lets 1 through, its share
    async with _router(1, "--rate-limit-rps", "0.01", "--rate-limit-burst", "2") as (port, proc):
        # a connection each: 40 reach both workers but with odds of 2 ** -39
        statuses = [await _complete(port) for _ in range(40)]
        assert statuses.count(200) == 2 and statuses.count(429) == 38
        assert _stop(proc) == 0


def test_a_dead_worker_takes_the_router_down():
    asyncio.run(asyncio.wait_for(_dead_worker(), 120))


async def _dead_worker():
    async with _router(1) as (_, proc):
        os.kill(_children(proc.pid)[0], signal.SIGKILL)
        for _ in range(600):  # and it stopped the other worker
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.1)  # (the fake instance runs on this loop)
        assert proc.returncode == 1
