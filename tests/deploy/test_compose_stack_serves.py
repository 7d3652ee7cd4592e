"""The compose stack as written actually serves, without a Docker engine.

Each service of deploy/compose/docker-compose.yml (redis, kvstore, prefill, decode, router)
runs as a local process with exactly its compose `command`, interpolated with the compose
file's variables, where the only changes are what a container network gives for free:
  - every port variable points at a free loopback port (the stack's own .env mechanism);
  - PDSERVE_MODEL=tiny, MAX_MODEL_LEN=512 and a small KV_CACHE_BYTES (also just variables);
  - service host names (redis, kvstore, decode, ...) and 0.0.0.0 become 127.0.0.1;
  - the image's entrypoint `pdserve` is `python -m pdserve.cli`, `pdserve-healthcheck` is
    deploy/docker/healthcheck.py, Redis is Debian's redis-server, and its /data volume and the
    secrets volumes under /etc/pdserve temporary directories.
The one-shot secrets step runs first (a CA, per-role certificates, Redis's password); then the
services start in depends_on order, each dependency waited for with its own compose health
check command (condition: service_healthy), the engines and the router on mutual TLS. The router is given no address: the engines register in Redis (with the
password from the secrets volume) and the router watches that registry. Then a chat
completion goes through the router the disaggregated way (prefill computes the prompt and saves its KV blocks in the store,
decode loads them and finishes), and the image's argument-less health check (auto mode)
passes for every pdserve process.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"
STACK = ["secrets", "redis", "kvstore", "prefill", "decode", "router"]
SERVICE_HOSTS = ("redis", "kvstore", "prefill", "decode", "router")
PORT_VARS = ("REDIS_PORT", "KVSTORE_PORT", "PREFILL_PORT", "DECODE_PORT", "ROUTER_PORT",
             "ROUTER_GRPC_PORT", "PREFILL_METRICS_PORT", "DECODE_METRICS_PORT")


def _compose_module():
    from pdserve.tests.deploy import compose_files

    return compose_files


def _free_port() -> int:
    from pdserve.services.ports import free_port

    return free_port()


def localize(argv: list[str], tmp: Path) -> list[str]:
    """What the container network and the image provide, on this machine."""
    out = []
    host_re = re.compile(r"(?<![\w.-])(%s)(?=:\d)" % "|".join(SERVICE_HOSTS))
    for i, word in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev == "--host" and (word in SERVICE_HOSTS or word == "0.0.0.0"):
            word = "127.0.0.1"
        elif prev == "--dir" and word == "/data":
            word = str(tmp)
        elif prev == "--dns":
            pass  # certificate names, not addresses
        else:
            word = host_re.sub("127.0.0.1", word)
        out.append(word.replace("/etc/pdserve/", f"{tmp}/etc-pdserve/"))  # the volumes
    if out[0] == "CMD-SHELL":
        return ["sh", "-c", out[1]]
    if out[0] in ("serve", "certs"):
        return [sys.executable, "-m", "pdserve.cli", *out]
    if out[0] == "pdserve-healthcheck":
        return [sys.executable, str(HEALTHCHECK), *out[1:]]
    if out[0] in ("redis-server", "redis-cli"):
        exe = shutil.which(out[0])
        extra = ["--bind", "127.0.0.1"] if out[0] == "redis-server" else []
        return [exe, *out[1:], *extra]
    raise AssertionError(f"unexpected command {argv!r}")


class Proc:
    def __init__(self, name: str, argv: list[str], log_dir: Path):
        self.name, self.argv = name, argv
        self.log = log_dir / f"{name}.log"
        with open(self.log, "wb") as f:
            self.popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, cwd=ROOT)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-25:])


def wait_healthy(proc: Proc, check: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            pytest.fail(f"{proc.name} exited ({proc.popen.returncode}) during startup:\n"
                        f"{proc.tail()}")
        last = subprocess.run(check, capture_output=True, text=True, timeout=30, cwd=ROOT)
        if last.returncode == 0:
            return
        time.sleep(0.5)
    pytest.fail(f"{proc.name} not healthy after {timeout_s}s by its compose health check "
                f"{check}: {last.stdout}{last.stderr}\n{proc.tail()}")


def _finished(address: str, service: str, tls_dir: Path) -> int:
    from pdserve.common.rpc import engine_pb2 as pb
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
    from pdserve.services.common.tls import TlsConfig, open_channel

    stub = pb_grpc.PrefillServiceStub if service == "prefill" else pb_grpc.DecodeServiceStub
    with open_channel(address, TlsConfig.from_dir(str(tls_dir), "client"), service,
                      aio=False) as ch:
        return stub(ch).GetLoad(pb.LoadRequest(), timeout=5).num_finished


def _registered(data: Path) -> set[tuple[str, str]]:
    """(role, address) of every instance in the registry, read with the stack's password."""
    import redis

    from pdserve.services.registry.config import KEY_PREFIX
    from pdserve.services.registry.record import InstanceRecord

    url = (data / "etc-pdserve" / "redis-auth" / "redis-url").read_text().strip()
    client = redis.Redis.from_url(url.replace("@redis:", "@127.0.0.1:"))
    try:
        records = [InstanceRecord.from_json(v) for v in
                   client.mget(list(client.scan_iter(match=KEY_PREFIX + "*")))]
    finally:
        client.close()
    return {(r.role, r.address) for r in records}


@pytest.fixture(scope="module")
def redis_available():
    if shutil.which("redis-server") is None and (ROOT / "scripts" / "ensure_redis.sh").exists():
        subprocess.run(["bash", str(ROOT / "scripts" / "ensure_redis.sh")], check=False,
                       timeout=300)
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server/redis-cli not installed (scripts/ensure_redis.sh)")


def test_compose_stack_serves_a_chat_completion(tmp_path, redis_available):
    compose = _compose_module()
    env = {var: str(_free_port()) for var in PORT_VARS}
    env.update(PDSERVE_MODEL="tiny", MAX_MODEL_LEN="512", KV_CACHE_BYTES=str(8 << 20),
               KVSTORE_CAPACITY_MIB="64")
    services = compose.load_compose(env=env)["services"]
    data = tmp_path / "redis-data"
    data.mkdir()
    tls_dir = data / "etc-pdserve" / "tls"
    procs: dict[str, Proc] = {}
    try:
        for name in STACK:
            svc = services[name]
            for dep, cond in svc.get("depends_on", {}).items():
                want = "service_completed_successfully" if dep == "secrets" else \
                    "service_healthy"
                assert cond["condition"] == want and dep in procs, (name, dep)
            procs[name] = Proc(name, localize(svc["command"], data), tmp_path)
            if name == "secrets":  # one-shot
                assert procs[name].popen.wait(60) == 0, procs[name].tail()
                continue
            test = svc["healthcheck"]["test"]
            check = localize(test if test[0] == "CMD-SHELL" else test[1:], data)
            wait_healthy(procs[name], check, timeout_s=180)
        # Redis wants its password; the engines want a certificate
        noauth = subprocess.run([shutil.which("redis-cli"), "-p", env["REDIS_PORT"], "ping"],
                                capture_output=True, text=True, timeout=10)
        assert "NOAUTH" in noauth.stdout + noauth.stderr
        import grpc

        from pdserve.common.rpc import engine_pb2 as pb
        from pdserve.common.rpc import engine_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"127.0.0.1:{env['DECODE_PORT']}") as ch, \
                pytest.raises(grpc.RpcError):
            pb_grpc.DecodeServiceStub(ch).Health(pb.HealthRequest(), timeout=5)

        base = f"http://127.0.0.1:{env['ROUTER_PORT']}"
        with httpx.Client(base_url=base, timeout=120) as client:
            models = client.get("/v1/models").json()
            assert models["data"][0]["id"] == "tiny"
            resp = client.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello from compose!"}]})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["object"] == "chat.completion"
            assert body["usage"]["completion_tokens"] >= 1
            assert isinstance(body["choices"][0]["message"]["content"], str)
            assert client.get("/metrics").status_code == 200

        # The router was given no address: it found both engines in the registry, where
        # each registered itself with the password from the secrets step's file.
        assert _registered(data) == {("prefill", f"127.0.0.1:{env['PREFILL_PORT']}"),
                                     ("decode", f"127.0.0.1:{env['DECODE_PORT']}")}
        for var in ("PREFILL_METRICS_PORT", "DECODE_METRICS_PORT"):  # Prometheus' targets
            metrics = httpx.get(f"http://127.0.0.1:{env[var]}/metrics", timeout=10).text
            assert "vllm:" in metrics, var
        # It went the disaggregated way: prefill computed the prompt, decode the rest.
        for name, service in (("prefill", "prefill"), ("decode", "decode")):
            port = env["PREFILL_PORT" if name == "prefill" else "DECODE_PORT"]
            assert _finished(f"127.0.0.1:{port}", service, tls_dir) >= 1, name
        hc = _compose_module().healthcheck_parser()
        from pdserve.services.common.tls import TlsConfig

        # the master is on mutual TLS and serves its own role's certificate
        stats = hc._master_stats(f"127.0.0.1:{env['KVSTORE_PORT']}",
                                 TlsConfig.from_dir(str(tls_dir), "kvstore-master"))
        assert stats.objects >= 1 and len(stats.nodes) == 1  # the prompt's blocks, stored
        kv_log = (tmp_path / "kvstore.log").read_text()
        assert "mutual TLS" in kv_log and "no store secret" not in kv_log

        # The image's HEALTHCHECK (no arguments) finds each service's port from its own
        # command line; run it against each process here.
        for name in ("kvstore", "prefill", "decode", "router"):
            res = subprocess.run([sys.executable, str(HEALTHCHECK), "--pid",
                                  str(procs[name].popen.pid)], capture_output=True, text=True,
                                 timeout=30, cwd=ROOT)
            assert res.returncode == 0, (name, res.stdout, res.stderr)
        res = subprocess.run([sys.executable, str(HEALTHCHECK), "kvstore-node",
                              f"127.0.0.1:{env['KVSTORE_PORT']}", "kvstore",
                              "--tls-dir", str(tls_dir)],
                             capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert res.returncode == 0, res.stderr  # the node the compose command names
        # ... and it says "unhealthy" for a port nobody serves, or a node nobody registered.
        res = subprocess.run([sys.executable, str(HEALTHCHECK), "kvstore-node",
                              f"127.0.0.1:{env['KVSTORE_PORT']}", "no-such-node",
                              "--tls-dir", str(tls_dir)],
                             capture_output=True, timeout=30)
        assert res.returncode == 1
        res = subprocess.run([sys.executable, str(HEALTHCHECK), "engine",
                              f"127.0.0.1:{_free_port()}"], capture_output=True, timeout=30)
        assert res.returncode == 1
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop()
    assert all(p.popen.returncode is not None for p in procs.values())
