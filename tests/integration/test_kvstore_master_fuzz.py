"""hypothesis (derandomized) over the KV store master's request messages (every data-plane
call, RegisterNode and Remove without the store secret's token), against a live master with a
store secret and one node: every call ends OK or with a client status (never UNKNOWN,
INTERNAL, UNAVAILABLE or a non-gRPC error); no call registers a node; once the fuzzed puts are
revoked and removed, the master's object count and the node's used bytes are back at their
baseline (nothing leaked: no lease, no allocation)."""

import asyncio
import time

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.connector.kvstore.auth import StoreKeys, remove_body, sign_token
from pdserve.services.kvstore.config import MasterConfig
from pdserve.services.kvstore.master_service import start_master
from pdserve.tests.integration.test_kvstore_master import _nodes

SECRET = "cd" * 32
BAD = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
       grpc.StatusCode.DEADLINE_EXCEEDED)
KEY = st.one_of(st.sampled_from([bytes([i]) * 32 for i in range(4)]), st.binary(max_size=40))
KEYS = st.lists(KEY, max_size=6)
SIZE = st.one_of(st.integers(0, 5000), st.sampled_from([2 ** 40, 2 ** 64 - 1]))
LEASE = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 120))
put_start = st.builds(pb.PutStartRequest, key=KEY, size=SIZE, lease_s=LEASE,
                      replica_num=st.integers(0, 2 ** 32 - 1))
REQUESTS = st.one_of(
    put_start,
    st.builds(pb.BatchPutStartRequest, entries=st.lists(put_start, max_size=4)),
    st.builds(pb.PutEndRequest, key=KEY), st.builds(pb.PutRevokeRequest, key=KEY),
    st.builds(pb.BatchPutEndRequest, keys=KEYS), st.builds(pb.BatchPutRevokeRequest, keys=KEYS),
    st.builds(pb.GetReplicaListRequest, key=KEY),
    st.builds(pb.BatchGetReplicaListRequest, keys=KEYS),
    st.builds(pb.BatchExistsRequest, keys=KEYS), st.builds(pb.PrefixLookupRequest, keys=KEYS),
    st.builds(pb.RemoveRequest, keys=KEYS, force=st.booleans(), auth=st.binary(max_size=48)),
    st.builds(pb.RegisterNodeRequest, node_id=st.text(max_size=8), address=st.text(max_size=24),
              capacity=st.integers(0, 2 ** 64 - 1), incarnation=st.text(max_size=8),
              auth=st.binary(max_size=48)),
    st.builds(pb.HeartbeatRequest, node_id=st.text(max_size=8),
              incarnation=st.text(max_size=8)))


def _method(req) -> str:
    return type(req).__name__.removesuffix("Request")


def _started_keys(req) -> list[bytes]:
    if isinstance(req, pb.PutStartRequest):
        return [req.key]
    if isinstance(req, pb.BatchPutStartRequest):
        return [e.key for e in req.entries]
    return []


def test_fuzzed_master_requests_are_answered_and_leak_nothing(redis_url, tmp_path):
    secret = tmp_path / "store.secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    admin = StoreKeys.from_secret(SECRET.encode())
    cfg = MasterConfig(port=0, redis_url=redis_url, namespace=f"fuzz:{tmp_path.name}",
                       store_secret_file=str(secret), max_lease_s=600.0)
    codes: dict = {}
    started: set = set()

    async def main():
        running = await start_master(cfg)
        try:
            await _nodes(running.core, 1)
            loop = asyncio.get_running_loop()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
                stub = pb_grpc.KVStoreMasterStub(ch)
                base = await stub.Stats(pb.StatsRequest(), timeout=5)

                async def call(req):
                    try:
                        await getattr(stub, _method(req))(req, timeout=10)
                        return grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as err:
                        return err.code()

                @settings(max_examples=150, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(REQUESTS)
                def one(req):
                    started.update(_started_keys(req))
                    code = asyncio.run_coroutine_threadsafe(call(req), loop).result(30)
                    codes[code] = codes.get(code, 0) + 1
                    assert code not in BAD, (req, code)

                await loop.run_in_executor(None, one)
                keys = sorted(k for k in started if 1 <= len(k) <= 64)  # only these start
                await stub.BatchPutRevoke(pb.BatchPutRevokeRequest(keys=keys), timeout=10)
                token = sign_token(admin.admin, b"remove", remove_body(keys, True), time.time())
                await stub.Remove(pb.RemoveRequest(keys=keys, force=True, auth=token),
                                  timeout=10)
                return base, await stub.Stats(pb.StatsRequest(), timeout=5)
        finally:
            await running.stop(0)

    base, after = asyncio.run(asyncio.wait_for(main(), 120))
    assert codes.get(grpc.StatusCode.OK, 0) >= 20, codes
    assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) >= 5, codes
    assert codes.get(grpc.StatusCode.UNAUTHENTICATED, 0) >= 1, codes
    assert [n.node_id for n in after.nodes] == ["n0"]  # no fuzzed registration took
    assert after.objects == base.objects
    assert after.nodes[0].used == base.nodes[0].used
