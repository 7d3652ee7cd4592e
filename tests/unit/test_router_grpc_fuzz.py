"""hypothesis (derandomized) over the router's gRPC GenerateRequest against a live router and
one fake instance: every call ends OK or with a client status (INVALID_ARGUMENT, NOT_FOUND for
another model), never INTERNAL / UNKNOWN / UNAVAILABLE or a non-gRPC error; the instance stays
up with its breaker closed, the router has no call left open, and its open file descriptors
(connections) are back near where they started."""

import asyncio
import os

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import router_pb2, router_pb2_grpc
from pdserve.tests.integration.test_query_of_death import fuzz_params
from pdserve.tests.unit.test_router_limits import router

CLIENT_CODES = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
IDS = st.lists(st.one_of(st.integers(0, 300), st.sampled_from([2 ** 31, 2 ** 32 - 1])),
               max_size=8)
fuzz_generate = st.builds(
    router_pb2.GenerateRequest, request_id=st.text(max_size=8),
    model=st.sampled_from(["", "fake", "other"]), params=fuzz_params,
    cache_salt=st.one_of(st.none(), st.text(max_size=8))).flatmap(
    lambda req: st.one_of(
        st.just(req),
        st.text(max_size=12).map(lambda t: _with(req, text=t)),
        IDS.map(lambda ids: _with(req, token_ids=router_pb2.TokenIds(ids=ids))),
        st.lists(st.builds(router_pb2.ChatMessage, role=st.text(max_size=9),
                           content=st.text(max_size=9)), max_size=3).map(
            lambda ms: _with(req, chat=router_pb2.ChatMessages(messages=ms)))))


valid_generate = st.builds(
    router_pb2.GenerateRequest, request_id=st.text(max_size=8),
    model=st.sampled_from(["", "fake"]), text=st.text(min_size=1, max_size=12),
    params=st.builds(pb.SamplingParams, max_tokens=st.integers(1, 4),
                     temperature=st.floats(0, 2), top_k=st.integers(0, 50),
                     stop=st.lists(st.text(min_size=1, max_size=4), max_size=2)),
    cache_salt=st.one_of(st.none(), st.text(max_size=8)))


def _with(req, **field):
    out = router_pb2.GenerateRequest()
    out.CopyFrom(req)
    for name, value in field.items():
        if isinstance(value, str):
            setattr(out, name, value)
        else:
            getattr(out, name).CopyFrom(value)
    return out


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_fuzzed_generate_requests_are_served_or_refused():
    codes: dict = {}

    async def main():
        async with router() as (r, fake):
            loop = asyncio.get_running_loop()
            addr = f"127.0.0.1:{r.grpc_port}"

            async def call(req):
                async with grpc.aio.insecure_channel(addr) as ch:
                    try:
                        [m async for m in router_pb2_grpc.RouterStub(ch).Generate(
                            req, timeout=20)]
                        return grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as err:
                        return err.code()

            def check(req):
                code = asyncio.run_coroutine_threadsafe(call(req), loop).result(30)
                codes[code] = codes.get(code, 0) + 1
                assert code in CLIENT_CODES, (req, code)

            @settings(max_examples=120, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(st.one_of(fuzz_generate, valid_generate))
            def one(req):
                check(req)

            fds = _open_fds()
            await loop.run_in_executor(None, one)
            (backend,) = r.state.pool.backends
            return fds, _open_fds(), backend, fake.calls
    fds_before, fds_after, backend, served = asyncio.run(asyncio.wait_for(main(), 120))
    assert codes.get(grpc.StatusCode.OK, 0) >= 5 and served >= 5, codes
    assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) >= 5, codes
    assert backend.up and backend.breaker.state == "closed"
    assert backend.inflight == 0 and backend.inflight_tokens == 0
    assert fds_after <= fds_before + 8  # each example's channel closed with it
