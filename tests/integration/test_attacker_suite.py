"""Issue 13's attacker suite: each attack hits ONE live disaggregated stack started from
`pdserve up`'s own plan with everything on (tests/integration/secure_stack.py: mutual TLS,
Redis password, store and block secrets, API keys for two tenants), and each must be refused
while "nothing else notices": after every attack a good request still gets the greedy text,
both engines are SERVING with no failed step, the router still routes to both and no circuit
breaker has opened.

The attacker can reach every port. Unless an attack says otherwise it holds no certificate and
no secret; some attacks give it an engine's certificate (a compromised or misused client of the
store) to show what the store's own checks refuse: capabilities and the block MAC.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from concurrent import futures

import grpc
import httpx
import pytest
import redis
import torch

from pdserve.common.kv.block_hash import chain_seed, hash_blocks
from pdserve.common.rpc import engine_pb2 as epb
from pdserve.common.rpc import engine_pb2_grpc as epb_grpc
from pdserve.common.rpc import kvstore_pb2 as kpb
from pdserve.common.rpc import kvstore_pb2_grpc as kpb_grpc
from pdserve.common.rpc import router_pb2 as rpb
from pdserve.common.rpc import router_pb2_grpc as rpb_grpc
from pdserve.connector.codec import BlockCodec
from pdserve.connector.kvstore.client import KVStoreClient
from pdserve.connector.kvstore.node_protocol import READ, WRITE, NodeOp
from pdserve.connector.kvstore.records import PutStatus
from pdserve.connector.transport import RemoteError, framing, make_transport
from pdserve.services.common.certs import CertSpec, make_certs
from pdserve.services.common.tls import TlsConfig, open_channel
from pdserve.services.registry.config import KEY_PREFIX
from pdserve.services.registry.record import InstanceRecord
from pdserve.services.router.admission.tenants import TenantSalts
from pdserve.tests.integration.disagg_helpers import metric, wait_for
from pdserve.tests.integration.kvstore_cluster import node_addresses
from pdserve.tests.integration.secure_stack import HOST, TENANTS, secure_stack
from pdserve.tests.integration.services_helpers import offline_engine

BLOCK_SIZE = 16
GOOD = [(5 * j) % 150 + 20 for j in range(20)]  # the good request after every attack
GOOD_TOKENS = 6
FORGED = [(11 * j) % 170 + 13 for j in range(3 * BLOCK_SIZE + 1)]  # 3 full blocks
SALTED = [(13 * j) % 160 + 17 for j in range(2 * BLOCK_SIZE + 3)]
MIB = 1 << 20


@pytest.fixture(scope="module")
def reference():
    """The tiny model in this process: greedy texts, its fingerprint and KV geometry."""
    llm = offline_engine()
    return llm


def greedy(llm, prompt: list[int], max_tokens: int) -> str:
    from pdserve.common.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    return llm.tokenizer.decode(out.token_ids)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with secure_stack(tmp_path_factory.mktemp("attacks")) as s:
        yield s


def complete(stack, prompt, max_tokens=GOOD_TOKENS, tenant=TENANTS[0], **body):
    return httpx.post(f"{stack.http_url}/v1/completions", headers=stack.auth(tenant),
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, **body}, timeout=60)


def engine_call(stack, name: str, method: str):
    service = "prefill" if name.startswith("prefill") else "decode"
    stub = epb_grpc.PrefillServiceStub if service == "prefill" else epb_grpc.DecodeServiceStub
    tls = TlsConfig.from_dir(stack.tls_dir, "client")
    with open_channel(stack.engines[name], tls, service, aio=False) as ch:
        req = epb.HealthRequest() if method == "Health" else epb.LoadRequest()
        return getattr(stub(ch), method)(req, timeout=5)


def codec_rejections(stack) -> int:
    """Blocks the engines fetched from the store and refused (header or MAC), since start."""
    return sum(engine_call(stack, n, "GetLoad").kv.failure_reasons.get("codec", 0)
               for n in stack.engines)


def nothing_noticed(stack, reference) -> None:
    r = complete(stack, GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy(reference, GOOD, GOOD_TOKENS)
    for name in stack.engines:
        assert engine_call(stack, name, "Health").status == epb.HealthResponse.SERVING
        assert engine_call(stack, name, "GetLoad").num_step_failures == 0
    assert stack.routed()
    for address in stack.engines.values():
        assert metric(stack.http_url, "pdserve_router_breaker_opened_total",
                      f'instance="{address}"') == 0


def store_client(stack, role: str = "prefill", block_keys=None) -> KVStoreClient:
    """A client of the store holding `role`'s certificate (and, given, the block keys)."""
    tls = TlsConfig.from_dir(stack.tls_dir, role)
    return KVStoreClient(stack.master, "tcp", block_keys=block_keys,
                         open_channel=lambda a: open_channel(a, tls, "kvstore-master"))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


# --- the attacks -------------------------------------------------------------------------

def no_certificate(stack, reference):
    """Plaintext or certificate-less clients: every gRPC server refuses the handshake; the
    HTTP API wants an API key."""
    targets = [(stack.engines["decode0"], lambda ch: epb_grpc.DecodeServiceStub(ch).Health(
                   epb.HealthRequest(), timeout=5)),
               (stack.engines["prefill0"], lambda ch: epb_grpc.PrefillServiceStub(ch).Health(
                   epb.HealthRequest(), timeout=5)),
               (stack.master, lambda ch: kpb_grpc.KVStoreMasterStub(ch).Stats(
                   kpb.StatsRequest(), timeout=5)),
               (stack.grpc_addr, lambda ch: list(rpb_grpc.RouterStub(ch).Generate(
                   rpb.GenerateRequest(text="hi"), timeout=5)))]
    ca = open(f"{stack.tls_dir}/ca.pem", "rb").read()
    for addr, call in targets:
        for ch in (grpc.insecure_channel(addr),
                   grpc.secure_channel(addr, grpc.ssl_channel_credentials(ca))):
            with ch, pytest.raises(grpc.RpcError) as err:
                call(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, addr
    r = httpx.post(f"{stack.http_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"]


def forged_block(stack, reference):
    """With an engine's certificate but not the block secret, the attacker writes blocks of
    attacker-chosen KV first: under the keys it can compute (the raw block hashes, with and
    without guessing the tenant salt away) and under the real store keys (as if it learned
    them) sealed with a MAC key of its own. The request then decodes the greedy text: the
    forged blocks at the real keys were fetched and refused by their MAC, and recomputed."""
    engine = reference.engine
    cfg = engine.model_config
    forger = BlockCodec(engine.fingerprint, cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads,
                        cfg.head_dim, dtype=engine.kv_dtype, mac_key=os.urandom(32))
    salt = TenantSalts(stack.tenant_secret).salt(TENANTS[0], None)
    real = hash_blocks(chain_seed(engine.fingerprint, BLOCK_SIZE, salt), FORGED, BLOCK_SIZE)
    guessed = hash_blocks(chain_seed(engine.fingerprint, BLOCK_SIZE, None), FORGED, BLOCK_SIZE)

    def forged(key: bytes) -> bytearray:
        out = bytearray(forger.nbytes)
        forger.encode_into(key, torch.randn(forger.payload_shape).to(forger.dtype), out)
        return out

    async def write_first():
        async with store_client(stack) as raw, \
                store_client(stack, block_keys=stack.block_keys) as keyed:
            for key in guessed + real:  # computable keys, as written
                assert await raw.put(key, forged(key), lease_s=60) is PutStatus.OK
            for key in real:  # the real object keys, without the MAC key
                assert await keyed.put(key, forged(key), lease_s=60) is PutStatus.OK
    before = codec_rejections(stack)
    run(write_first())
    r = complete(stack, FORGED, max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy(reference, FORGED, 8)
    assert codec_rejections(stack) > before  # fetched, refused by the MAC, recomputed


def read_outside_grant(stack, reference):
    """An engine's certificate gets a READ grant for its own block; the node refuses the same
    grant moved, widened or forged, and a READ with none (the whole segment: every tenant's
    KV)."""
    block = os.urandom(4096)

    async def main():
        async with store_client(stack) as kv:
            assert await kv.put(b"attacker-own", block, lease_s=60) is PutStatus.OK
            rep = (await kv.replicas(b"attacker-own")).replicas[0]
        conn = await make_transport("tcp").connect(rep.address)
        try:
            for op in (NodeOp(READ, rep.offset + 64, len(block), rep.capability),
                       NodeOp(READ, rep.offset, 2 * len(block), rep.capability),
                       NodeOp(READ, 0, 8 * MIB),
                       NodeOp(READ, rep.offset, len(block), bytes(len(rep.capability)))):
                with pytest.raises(RemoteError, match="refused"):
                    await conn.request(op.encode())
        finally:
            await conn.close()
    run(main())


def oversized_frame(stack, reference):
    """A frame claiming a 2**62-byte payload: the node answers with an error frame before
    allocating anything."""
    (address,) = node_addresses(stack.master, stack.tls_dir).values()
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(framing.pack(framing.KIND_REQUEST, NodeOp(WRITE, 0, 2**62).encode(), 2**62))
        prefix = s.recv(framing.PREFIX.size)
    assert framing.PREFIX.unpack(prefix)[0] == framing.KIND_ERROR


def rogue_register_node(stack, reference):
    """RegisterNode with a huge capacity (to attract placements) or over the live node's id:
    refused with an engine's certificate and with a storage node's (no store secret)."""
    before = node_addresses(stack.master, stack.tls_dir)
    (live_id,) = before
    for role in ("prefill", "kvstore-node"):
        tls = TlsConfig.from_dir(stack.tls_dir, role)
        with open_channel(stack.master, tls, "kvstore-master", aio=False) as ch:
            stub = kpb_grpc.KVStoreMasterStub(ch)
            for node_id in ("rogue", live_id):
                req = kpb.RegisterNodeRequest(node_id=node_id, address="10.9.9.9:1",
                                              capacity=1 << 40, incarnation="evil")
                with pytest.raises(grpc.RpcError) as err:
                    stub.RegisterNode(req, timeout=5)
                assert err.value.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                            grpc.StatusCode.PERMISSION_DENIED), role
    assert node_addresses(stack.master, stack.tls_dir) == before


class _RogueEngine:
    """A gRPC server with a decode certificate from another CA, counting every call that
    reaches it (none should: the router checks its certificate before sending anything)."""

    def __init__(self, cert_dir):
        self.calls = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(2),
                                  handlers=[self])  # GenericRpcHandler: service()
        creds = grpc.ssl_server_credentials([((cert_dir / "decode-key.pem").read_bytes(),
                                              (cert_dir / "decode.pem").read_bytes())])
        port = self.server.add_secure_port(f"{HOST}:0", creds)
        self.address = f"{HOST}:{port}"
        self.server.start()

    def service(self, handler_call_details):
        with self._lock:
            self.calls += 1
        return None  # UNIMPLEMENTED


def fake_registry_entry(stack, reference, tmp_path_factory):
    """Without Redis's password the registry refuses the write; with it (Redis breached), an
    entry naming a server without a certificate of the stack's CA joins the router's pool but
    never passes a health check, so no request is sent to it."""
    entry_key = KEY_PREFIX.encode()
    url = stack.redis_url
    host_port = url.rsplit("@", 1)[1].split("/", 1)[0]
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(f"redis://{host_port}/1").set(entry_key + b"x", b"{}")
    other = tmp_path_factory.mktemp("rogue-ca")
    make_certs(other, CertSpec(roles=("decode",)))
    rogue = _RogueEngine(other)
    fingerprint = engine_call(stack, "decode0", "Health").model_fingerprint
    record = InstanceRecord(rogue.address, "decode", "tiny", fingerprint=fingerprint,
                            block_size=BLOCK_SIZE)
    db = redis.Redis.from_url(url.rsplit("/", 1)[0] + "/1")
    try:
        db.set(KEY_PREFIX + rogue.address, record.to_json(), px=60_000)
        wait_for(lambda: f'instance="{rogue.address}"' in httpx.get(
            f"{stack.http_url}/metrics", timeout=5).text, 20, "the rogue entry joined")
        for _ in range(4):  # round robin or not: none of these may reach it
            assert complete(stack, GOOD).status_code == 200
        assert metric(stack.http_url, "pdserve_instance_up", f'instance="{rogue.address}"') == 0
        assert rogue.calls == 0
    finally:
        db.delete(KEY_PREFIX + rogue.address)
        db.close()
        rogue.server.stop(0)


def huge_stop_string(stack, reference):
    """A 5 MB stop string is the client's error (4xx, OpenAI-shaped), never an instance
    failure: sent more times than it takes to open a breaker."""
    for _ in range(4):
        r = complete(stack, "hi", stop=["s" * (5 * MIB)])
        assert 400 <= r.status_code < 500, r.status_code
        assert r.json()["error"]["message"]


def guessed_cache_salt(stack, reference):
    """Tenant beta guesses the cache_salt tenant alpha uses: no cached_tokens across tenants,
    while alpha's own repeat is a cache hit (so the probe could have seen one)."""
    def cached(tenant):
        r = complete(stack, SALTED, max_tokens=2, tenant=tenant, cache_salt="team-salt")
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached(TENANTS[0]) == 0
    assert cached(TENANTS[0]) >= BLOCK_SIZE
    assert cached(TENANTS[1]) == 0


ATTACKS = {f.__name__: f for f in (no_certificate, forged_block, read_outside_grant,
                                    oversized_frame, rogue_register_node, fake_registry_entry,
                                    huge_stop_string, guessed_cache_salt)}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_is_refused_and_nothing_else_notices(stack, reference, attack,
                                                   tmp_path_factory):
    fn = ATTACKS[attack]
    if fn is fake_registry_entry:
        fn(stack, reference, tmp_path_factory)
    else:
        fn(stack, reference)
    nothing_noticed(stack, reference)
