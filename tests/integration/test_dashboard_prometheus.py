"""The Grafana dashboard (deploy/grafana/pdserve-dashboard.json) against a real Prometheus
(Debian's binary) scraping a live tiny disaggregated stack: every PromQL expression in the
dashboard returns data through Prometheus' HTTP API.

The stack runs in this process (Redis, KV store master and node, a prefill and a decode engine
each with --metrics-port, the router); Prometheus scrapes the router's /metrics and both
engines' every second, with the `role` label the dashboard groups tiers by."""

import asyncio
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdserve.services.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
PREFIX = list(range(5, 53))  # three full blocks of 16: stored by prefill, loaded by decode


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", ())]


@pytest.fixture(scope="module")
def prometheus_bin():
    if shutil.which("prometheus") is None:
        subprocess.run(["bash", str(ROOT / "scripts" / "ensure_prometheus.sh")], check=True,
                       timeout=300)
    return shutil.which("prometheus")


async def start_stack(redis_url: str):
    """Everything a disaggregated deployment runs; returns (stop coroutine fn, targets)."""
    from pdserve.services.engine_host.engine_server import build_core, start_engine_server
    from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
    from pdserve.services.kvstore.config import MasterConfig, NodeConfig
    from pdserve.services.kvstore.master_service import start_master
    from pdserve.services.kvstore.node import start_node
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.router.server import start_router

    stops = []
    master = await start_master(MasterConfig(port=0, redis_url=redis_url))
    stops.append(lambda: master.stop(0.5))
    store = f"127.0.0.1:{master.port}"
    node = await start_node(NodeConfig(master_addr=store, capacity=16 << 20, transport="tcp"))
    stops.append(node.stop)
    engines, targets = {}, {}
    loop = asyncio.get_running_loop()
    for role in ("prefill", "decode"):
        mport = free_port("127.0.0.1")
        cfg = EngineServiceConfig(role=role, port=0, model="tiny", num_blocks=64,
                                  max_model_len=256, kv_store=store, kv_transport="tcp",
                                  metrics_port=mport)
        core = await loop.run_in_executor(None, build_core, cfg)
        running = await start_engine_server(cfg, core)
        assert await running.engine.wait_warmed_up()  # SERVING after warm-up
        stops.append(lambda r=running: r.stop(0.5))
        engines[role] = f"127.0.0.1:{running.port}"
        targets[role] = f"127.0.0.1:{mport}"
    router = await start_router(RouterConfig(
        model="tiny", backends=(engines["decode"],), prefill_backends=(engines["prefill"],),
        kv_store=store, port=0, grpc_port=-1, health_interval_s=0.3))
    stops.append(router.stop)
    targets["router"] = f"127.0.0.1:{router.http_port}"

    async def stop_all():
        for stop in reversed(stops):
            await stop()

    return stop_all, targets


@pytest.fixture(scope="module")
def stack(redis_url):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = (lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120))
    stop_all, targets = run(start_stack(redis_url))
    try:
        yield targets
    finally:
        run(stop_all())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def prometheus_config(targets: dict) -> str:
    jobs = [("pdserve-router", targets["router"], "router")] + [
        ("pdserve-engines", targets[role], role) for role in ("prefill", "decode")]
    lines = ["global:", "  scrape_interval: 1s", "  evaluation_interval: 1s",
             "scrape_configs:"]
    for job in ("pdserve-router", "pdserve-engines"):
        lines += [f"  - job_name: {job}", "    static_configs:"]
        for name, target, role in jobs:
            if name == job:
                lines += [f"      - targets: ['{target}']", f"        labels: {{role: {role}}}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def prometheus(prometheus_bin, stack, tmp_path_factory):
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(prometheus_config(stack))
    port = free_port("127.0.0.1")
    proc = subprocess.Popen(
        [prometheus_bin, f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"],
        stdout=open(work / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (work / "prometheus.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(url: str, expr: str) -> list:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def drive_traffic(router: str) -> None:
    """Requests that exercise every tier: prefills that store their blocks, decodes that load
    them, a repeated prefix (prefix and store hits), streaming and not."""
    with httpx.Client(base_url=f"http://{router}", timeout=60) as client:
        for i in range(4):
            body = {"model": "tiny", "prompt": PREFIX + [60 + i] * 8, "max_tokens": 6,
                    "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text


def test_every_dashboard_expression_returns_data(stack, prometheus):
    exprs = dashboard_exprs()
    assert len(exprs) >= 25
    wait_for(lambda: len([s for s in query(prometheus, "up") if s["value"][1] == "1"]) == 3,
             30, "prometheus did not see all three targets up")
    drive_traffic(stack["router"])
    # two scrapes after the traffic so every rate() has samples on both sides of it
    time.sleep(2.5)
    wait_for(lambda: query(prometheus, "sum(vllm:generation_tokens_total)") and float(
        query(prometheus, "sum(vllm:generation_tokens_total)")[0]["value"][1]) > 0, 15,
        "no generated tokens scraped")
    empty = [(title, expr) for title, expr in exprs if not query(prometheus, expr)]
    assert not empty, "dashboard expressions without data:\n" + "\n".join(
        f"  {t}: {e}" for t, e in empty)
    # and the tiers really are there: prefill and decode each have TTFT data
    roles = {s["metric"].get("role") for s in query(
        prometheus, "sum by (role) (vllm:time_to_first_token_seconds_count)")}
    assert {"prefill", "decode"} <= roles
    stored = query(prometheus, 'sum(pdserve_kv_transfer_bytes_total{direction="load"})')
    assert float(stored[0]["value"][1]) > 0  # decode loaded blocks that prefill stored
