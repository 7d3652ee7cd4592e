"""Mutual TLS on a live tiny engine and router (real processes, `--tls-dir` from `pdserve
certs`): a client without a certificate, with a certificate from another CA, or that does not
trust the stack's CA is refused at the handshake; the router, with its certificate, serves end
to end; its gRPC API wants a certificate too."""

import threading

import grpc
import httpx
import pytest

from pdserve.common.rpc import engine_pb2 as epb
from pdserve.common.rpc import engine_pb2_grpc as epb_grpc
from pdserve.common.rpc import router_pb2 as rpb
from pdserve.common.rpc import router_pb2_grpc as rpb_grpc
from pdserve.services.common.certs import CertSpec, make_certs
from pdserve.services.common.tls import TlsConfig, channel_options, open_channel
from pdserve.services.launcher import engine_serving, free_port, http_ok, wait_until
from pdserve.tests.integration.services_helpers import start_engine, start_router, \
    TINY_ENGINE_ARGS


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtls")
    certs, other = root / "certs", root / "other-ca"
    make_certs(certs)
    make_certs(other, CertSpec(roles=("router", "client")))  # same roles, another CA
    ep, hp, gp = (free_port("127.0.0.1") for _ in range(3))
    engine_addr = f"127.0.0.1:{ep}"
    tls = ["--tls-dir", str(certs)]
    children = []
    try:
        children.append(start_engine(root, ep, (*TINY_ENGINE_ARGS, *tls)))
        wait_until(lambda: engine_serving(engine_addr, "decode", str(certs)), children[0], 180,
                   threading.Event())
        children.append(start_router(root, [engine_addr], hp, gp, extra=tls))
        wait_until(lambda: http_ok(f"http://127.0.0.1:{hp}/health"), children[1], 60,
                   threading.Event())
        yield {"certs": certs, "other": other, "engine": engine_addr,
               "http": f"http://127.0.0.1:{hp}", "grpc": f"127.0.0.1:{gp}"}
    finally:
        for child in reversed(children):
            child.stop(10.0)


def engine_health(channel) -> epb.HealthResponse:
    return epb_grpc.DecodeServiceStub(channel).Health(epb.HealthRequest(), timeout=5)


def refused(channel) -> grpc.StatusCode:
    with channel, pytest.raises(grpc.RpcError) as info:
        engine_health(channel)
    return info.value.code()


def creds(ca, cert=None, key=None) -> grpc.ChannelCredentials:
    read = lambda p: p.read_bytes() if p is not None else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


def test_engine_refuses_clients_without_a_good_certificate(stack):
    addr, certs, other = stack["engine"], stack["certs"], stack["other"]
    opts = channel_options("decode")
    assert refused(grpc.insecure_channel(addr)) == grpc.StatusCode.UNAVAILABLE  # plaintext
    # TLS, trusting the right CA, but no client certificate
    assert refused(grpc.secure_channel(addr, creds(certs / "ca.pem"), opts)) == \
        grpc.StatusCode.UNAVAILABLE
    # a client certificate from another CA (trusting the engine's CA, so only the client's
    # certificate is wrong)
    foreign = creds(certs / "ca.pem", other / "client.pem", other / "client-key.pem")
    assert refused(grpc.secure_channel(addr, foreign, opts)) == grpc.StatusCode.UNAVAILABLE
    # a good client certificate, but a client that trusts only the other CA: it refuses the
    # engine's certificate
    wrong_trust = creds(other / "ca.pem", certs / "client.pem", certs / "client-key.pem")
    assert refused(grpc.secure_channel(addr, wrong_trust, opts)) == grpc.StatusCode.UNAVAILABLE
    # the same CA's client certificate is let in
    with open_channel(addr, TlsConfig.from_dir(str(certs), "client"), "decode",
                      aio=False) as ch:
        assert engine_health(ch).status == epb.HealthResponse.SERVING


def test_router_with_its_certificate_serves_end_to_end(stack):
    r = httpx.post(f"{stack['http']}/v1/completions", json={
        "model": "tiny", "prompt": "mutual tls", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    req = rpb.GenerateRequest(text="over grpc", params=epb.SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True))
    good = TlsConfig.from_dir(str(stack["certs"]), "client")
    with open_channel(stack["grpc"], good, "router", aio=False) as ch:
        msgs = list(rpb_grpc.RouterStub(ch).Generate(req, timeout=30))
    assert sum(len(m.token_ids) for m in msgs) == 3
    with grpc.insecure_channel(stack["grpc"]) as ch, pytest.raises(grpc.RpcError) as info:
        list(rpb_grpc.RouterStub(ch).Generate(req, timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_bench_grpc_client_speaks_mutual_tls(stack):
    """`pdserve bench ... --api grpc --tls-dir DIR` reaches a TLS router; without it, it
    records the refusal instead of tokens."""
    import asyncio
    import time

    from pdserve.bench.client_grpc import GrpcClient
    from pdserve.bench.record import StreamTrace
    from pdserve.bench.request import BenchRequest
    from pdserve.bench.target import TargetConfig

    async def one(tls_dir: str) -> StreamTrace:
        client = GrpcClient(TargetConfig(api="grpc", grpc_addr=stack["grpc"], tls_dir=tls_dir,
                                         timeout_s=30))
        await client.start()
        trace = StreamTrace(sent_t=time.perf_counter())
        try:
            await client.send(BenchRequest(tier="t", max_tokens=3, prompt="bench"), None, trace)
        finally:
            await client.close()
        return trace

    good = asyncio.run(one(str(stack["certs"])))
    assert good.error is None and good.usage_completion == 3
    bad = asyncio.run(one(""))
    assert bad.error is not None and "UNAVAILABLE" in bad.error and not bad.arrivals


def test_engine_serves_generation_to_the_router_role_only(stack):
    """Role checks: an API client's certificate (right CA, wrong role) may probe Health but not
    run a request on an engine; the router's certificate may."""
    req = epb.DecodeRequest(request_id="role-check", prompt_token_ids=[1, 2, 3],
                            params=epb.SamplingParams(max_tokens=2, temperature=0,
                                                      ignore_eos=True))
    client = TlsConfig.from_dir(str(stack["certs"]), "client")
    with open_channel(stack["engine"], client, "decode", aio=False) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(epb_grpc.DecodeServiceStub(ch).Decode(req, timeout=30))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "router" in info.value.details()
    router = TlsConfig.from_dir(str(stack["certs"]), "router")
    with open_channel(stack["engine"], router, "decode", aio=False) as ch:
        out = list(epb_grpc.DecodeServiceStub(ch).Decode(req, timeout=30))
    assert sum(len(m.token_ids) for m in out) == 2
