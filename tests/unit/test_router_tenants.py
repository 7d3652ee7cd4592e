"""Tenants and per-key limits: the key file's format; keys compared as bytes (a non-ASCII key
is a 401, never a 500); x-priority capped per key; rate limits per key, or per client address
without keys (rotating the bearer header does not escape); tenant cache salts are keyed
hashes that keep tenants' prefix caches apart (a live tiny engine: cached_tokens within a
tenant only)."""

import asyncio
import contextlib

import httpx
import pytest

from pdserve.bench.router_fakes import FakeInstance
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.admission.admission_config import AdmissionConfig
from pdserve.services.router.admission.api_keys import KeyRing, parse_key_line
from pdserve.services.router.admission.gate import Gate
from pdserve.services.router.admission.tenants import TenantSalts
from pdserve.services.router.api.errors import APIError
from pdserve.services.router.api.request_meta import RequestMeta, grpc_peer_host
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch.job import Choice, Job
from pdserve.services.router.server import start_router
from pdserve.tests.unit.fake_engine import FakeTokenizer

KEYS = """# tenants
sk-a1 tenant=acme max_priority=10
sk-a2 tenant=acme
sk-b  tenant=bravo max_priority=-5
sk-solo
"""


def test_key_file_format(tmp_path):
    f = tmp_path / "keys"
    f.write_text(KEYS)
    ring = KeyRing.load(str(f))
    by_key = {k.secret: k for k in ring.keys}
    assert by_key[b"sk-a1"].tenant == by_key[b"sk-a2"].tenant == "acme"
    assert by_key[b"sk-a1"].max_priority == 10 and by_key[b"sk-a2"].max_priority == 0
    assert by_key[b"sk-b"].max_priority == -5
    solo = by_key[b"sk-solo"]
    assert solo.tenant.startswith("key-") and "sk-solo" not in solo.tenant
    assert ring.match("sk-a2") is by_key[b"sk-a2"] and ring.match("sk-zz") is None
    for bad in ("sk tenant=", "sk color=red", "sk max_priority=high", "sk max_priority=5000"):
        f.write_text(f"ok\n{bad}\n")
        with pytest.raises(ValueError, match=":2:"):
            KeyRing.load(str(f))


def test_non_ascii_keys_never_raise(tmp_path):
    ring = KeyRing((parse_key_line("ключ-1 tenant=ru"),))
    wire = "ключ-1".encode("utf-8").decode("latin-1")  # as an HTTP header reaches us
    assert ring.match(wire).tenant == "ru"
    for presented in ("ключ-1x", "\udc80", "é", "日本", ""):
        assert ring.match(presented) is None
        with pytest.raises(APIError) as info:
            ring.check(presented)
        assert info.value.status == 401


def _gate(tmp_path, **admission):
    f = tmp_path / "keys"
    f.write_text(KEYS)
    cfg = RouterConfig(model="fake", api_key_file=str(f),
                       admission=AdmissionConfig(**admission))
    return Gate(cfg, RouterMetrics())


def test_priority_is_capped_per_key(tmp_path):
    gate = _gate(tmp_path)
    ask = RequestMeta(priority=1000)
    assert gate.identify(RequestMeta(api_key="sk-a1", priority=1000)).priority == 10
    assert gate.identify(RequestMeta(api_key="sk-a1", priority=3)).priority == 3
    assert gate.identify(RequestMeta(api_key="sk-a2", priority=1000)).priority == 0
    assert gate.identify(RequestMeta(api_key="sk-b", priority=0)).priority == -5
    assert gate.identify(RequestMeta(api_key="sk-a1", priority=-700)).priority == -700
    with pytest.raises(APIError):
        gate.identify(ask)  # no key
    open_gate = Gate(RouterConfig(model="fake", admission=AdmissionConfig(max_priority=5)),
                     RouterMetrics())
    assert open_gate.identify(RequestMeta(priority=1000, client="1.2.3.4")).priority == 5


def test_tenant_salts_are_keyed_and_per_tenant(tmp_path):
    gate = _gate(tmp_path)
    job = Job("r", (Choice(0, (1, 2, 3), SamplingParams(cache_salt="mine")),), "mine")

    def salt(key):
        return gate.isolate(job, gate.identify(RequestMeta(api_key=key))).cache_salt

    a1, a2, b, solo = salt("sk-a1"), salt("sk-a2"), salt("sk-b"), salt("sk-solo")
    assert a1 == a2 and len({a1, b, solo}) == 3
    isolated = gate.isolate(job, gate.identify(RequestMeta(api_key="sk-b")))
    assert isolated.choices[0].params.cache_salt == isolated.cache_salt == b
    assert "sk-" not in a1 and "acme" not in a1 and "mine" not in a1
    other_client_salt = Job("r", job.choices, "theirs")
    assert gate.isolate(other_client_salt, gate.identify(RequestMeta(api_key="sk-a1"))) \
        .cache_salt != a1
    # the same tenant under another router secret: another salt (it cannot be guessed)
    assert TenantSalts(b"x" * 16).salt("acme", "mine") != TenantSalts(b"y" * 16).salt("acme",
                                                                                       "mine")
    # no API keys: no tenants, the client's salt goes through
    open_gate = Gate(RouterConfig(model="fake"), RouterMetrics())
    assert open_gate.isolate(job, open_gate.identify(RequestMeta())).cache_salt == "mine"


def test_grpc_peer_host_drops_the_port():
    assert grpc_peer_host("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert grpc_peer_host("ipv6:[::1]:51234") == "ipv6:[::1]"
    assert grpc_peer_host("unix:/tmp/s") == "unix:/tmp/s"


@contextlib.asynccontextmanager
async def fake_router(**kw):
    fake = await FakeInstance.start(tokens=2)
    running = None
    try:
        running = await start_router(RouterConfig(model="fake", backends=(fake.address,),
                                                  port=0, grpc_port=-1, **kw),
                                     tokenizer=FakeTokenizer())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.http_port}",
                                     timeout=20) as client:
            yield client
    finally:
        if running is not None:
            await running.stop()
        await fake.stop()


BODY = {"prompt": "hi", "max_tokens": 2}


def test_rotating_the_bearer_header_does_not_escape_the_limit():
    async def main():
        limits = AdmissionConfig(rate_limit_rps=0.01, rate_limit_burst=2)
        async with fake_router(admission=limits) as c:
            return [(await c.post("/v1/completions", json=BODY,
                                  headers={"Authorization": f"Bearer rotated-{i}"})).status_code
                    for i in range(4)]
    assert asyncio.run(asyncio.wait_for(main(), 30)) == [200, 200, 429, 429]


def test_per_key_limits_and_non_ascii_headers_over_http(tmp_path):
    f = tmp_path / "keys"
    f.write_text(KEYS)

    async def main():
        limits = AdmissionConfig(rate_limit_rps=0.01, rate_limit_burst=1)
        async with fake_router(api_key_file=str(f), admission=limits) as c:
            def auth(key):
                return {"Authorization": b"Bearer " + key.encode("utf-8")}
            out = [(await c.post("/v1/completions", json=BODY, headers=auth(k))).status_code
                   for k in ("sk-a1", "sk-a1", "sk-a2", "ключ", "sk-b")]
            return out
    # sk-a1 is limited after one; sk-a2 (same tenant, its own key) is not; a non-ASCII key
    # is a 401
    assert asyncio.run(asyncio.wait_for(main(), 30)) == [200, 429, 200, 401, 200]


def test_cached_tokens_stay_within_a_tenant(tmp_path):
    """A live tiny engine: the second request of the same tenant reuses the first's prefix
    blocks; another tenant sending the same prompt computes it afresh (cached_tokens 0)."""
    import torch

    from pdserve.common.engine.engine_core import EngineCore
    from pdserve.services.engine_host.engine_server import start_engine_server
    from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
    from pdserve.services.router.api.tokenizer_loader import load_tokenizer

    f = tmp_path / "keys"
    f.write_text(KEYS)
    torch.set_num_threads(1)
    ecfg = EngineServiceConfig(role="unified", port=0, model="tiny", num_blocks=64,
                               max_model_len=256, block_size=16)
    prompt = list(range(1, 50))  # three full blocks

    async def main():
        engine = await start_engine_server(ecfg, EngineCore(ecfg.engine_config()))
        assert await engine.engine.wait_warmed_up()  # SERVING after warm-up
        running = None
        try:
            running = await start_router(RouterConfig(
                model="tiny", backends=(f"127.0.0.1:{engine.port}",), port=0, grpc_port=-1,
                api_key_file=str(f)), tokenizer=load_tokenizer("tiny"))
            cached = []
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.http_port}",
                                         timeout=60) as c:
                for key in ("sk-a1", "sk-a2", "sk-b", "sk-solo", "sk-b"):
                    r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                     json={"prompt": prompt, "max_tokens": 1,
                                           "temperature": 0})
                    assert r.status_code == 200, r.text
                    cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            return cached
        finally:
            if running is not None:
                await running.stop()
            await engine.stop(1.0)
    cached = asyncio.run(asyncio.wait_for(main(), 120))
    assert cached[0] == 0 and cached[1] >= 32  # acme's second key hits acme's blocks
    assert cached[2] == 0 and cached[3] == 0  # bravo and solo see nothing of acme's
    assert cached[4] >= 32  # bravo's own second request hits bravo's blocks
