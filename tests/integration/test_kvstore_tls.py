"""The KV store master on mutual TLS with role checks (a live master and storage node, real
processes, certificates from `pdserve certs`' code): the node registers over TLS; an engine's
certificate puts and gets; the router's looks up; a client without a certificate, with one
from another CA, or of a role the master does not serve is refused before any state changes;
the standard health service stays open to every certificate of the CA."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.connector.kvstore.client import KVStoreClient, StoreClientConfig
from pdserve.connector.kvstore.records import PutStatus
from pdserve.services.common.certs import CertSpec, make_certs
from pdserve.services.common.tls import TlsConfig, channel_options, open_channel
from pdserve.tests.integration.kvstore_cluster import secured_cluster

BLOCK = bytes(range(256)) * 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvtls")
    certs, other = root / "certs", root / "other-ca"
    make_certs(certs)
    make_certs(other, CertSpec(roles=("prefill", "router")))  # same roles, another CA
    with secured_cluster(root, tls_dir=str(certs)) as (maddr, _secret, nodes, _master):
        yield {"addr": maddr, "certs": certs, "other": other, "nodes": nodes}


def _client(store, role: str, certs=None) -> KVStoreClient:
    tls = TlsConfig.from_dir(str(certs or store["certs"]), role)
    return KVStoreClient(store["addr"], "tcp", config=StoreClientConfig(transport="tcp"),
                         open_channel=lambda a: open_channel(a, tls, "kvstore-master"))


def _stats_code(channel) -> grpc.StatusCode:
    with channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.KVStoreMasterStub(channel).Stats(pb.StatsRequest(), timeout=5)
    return info.value.code()


def test_engine_and_router_certificates_are_served(store):
    async def main():
        async with _client(store, "prefill") as kv:
            assert await kv.put(b"k-tls", BLOCK, lease_s=30) in (PutStatus.OK,
                                                                  PutStatus.EXISTS)
            assert await kv.get(b"k-tls") == BLOCK
        async with _client(store, "router") as kv:
            assert await kv.prefix_lookup([b"k-tls", b"absent"]) == 1

    asyncio.run(asyncio.wait_for(main(), 60))
    assert list(store["nodes"]) == ["n0"]  # the node registered over TLS


def test_clients_without_a_good_certificate_are_refused(store):
    addr, certs, other = store["addr"], store["certs"], store["other"]
    read = lambda p: p.read_bytes()  # noqa: E731
    opts = channel_options("kvstore-master")
    assert _stats_code(grpc.insecure_channel(addr)) == grpc.StatusCode.UNAVAILABLE
    no_cert = grpc.ssl_channel_credentials(read(certs / "ca.pem"))
    assert _stats_code(grpc.secure_channel(addr, no_cert, opts)) == grpc.StatusCode.UNAVAILABLE
    foreign = grpc.ssl_channel_credentials(read(certs / "ca.pem"), read(other / "router-key.pem"),
                                           read(other / "router.pem"))
    assert _stats_code(grpc.secure_channel(addr, foreign, opts)) == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_of_another_role_is_denied_but_may_probe_health(store):
    client = TlsConfig.from_dir(str(store["certs"]), "client")  # an API client's certificate
    ch = open_channel(store["addr"], client, "kvstore-master", aio=False)
    assert _stats_code(ch) == grpc.StatusCode.PERMISSION_DENIED
    rogue = pb.RegisterNodeRequest()
    with open_channel(store["addr"], client, "kvstore-master", aio=False) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.KVStoreMasterStub(ch).RegisterNode(rogue, timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
