"""The router's prefill fallbacks, in this process: stand-in prefill instances that pass their
health checks but fail every Prefill (unreachable, or too slow), a real tiny decode engine, and a
KV store master nobody listens at. The request is retried on the other prefill instance once,
then sent whole to decode: the same greedy tokens, and each counter moved exactly once."""

import asyncio
import contextlib

import grpc
import pytest
import torch

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.common.rpc import router_pb2, router_pb2_grpc
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_host.engine_server import build_core, start_engine_server
from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
from pdserve.services.launcher import free_port
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.server import start_router
from pdserve.tests.integration.services_helpers import offline_engine

PROMPT = list(range(20, 90))
MAX_TOKENS = 6


class BrokenPrefill(pb_grpc.PrefillServiceServicer):
    """Healthy to health checks; every Prefill fails as `mode` says."""

    def __init__(self, mode: str):
        self.mode = mode
        self.calls = 0

    async def Prefill(self, request, context):
        self.calls += 1
        if self.mode == "slow":
            await asyncio.sleep(30)  # the router's prefill timeout ends it first
        code = {"down": grpc.StatusCode.UNAVAILABLE,
                "bad": grpc.StatusCode.INVALID_ARGUMENT}[self.mode]
        await context.abort(code, f"broken prefill ({self.mode})")

    async def Health(self, request, context):
        return pb.HealthResponse(status=pb.HealthResponse.SERVING, role="prefill")

    async def GetLoad(self, request, context):
        return pb.LoadResponse()


@contextlib.asynccontextmanager
async def broken_prefill(mode: str):
    servicer = BrokenPrefill(mode)
    server = grpc.aio.server()
    pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def router_over(prefills: list[str]):
    cfg = EngineServiceConfig(role="decode", port=0, model="tiny", num_blocks=64,
                              max_model_len=256)
    core = await asyncio.get_running_loop().run_in_executor(None, build_core, cfg)
    engine = await start_engine_server(cfg, core)
    assert await engine.engine.wait_warmed_up()  # SERVING after warm-up
    router = None
    try:
        router = await start_router(RouterConfig(
            model="tiny", backends=(f"127.0.0.1:{engine.port}",), prefill_backends=tuple(prefills),
            kv_store=f"127.0.0.1:{free_port('127.0.0.1')}", port=0, grpc_port=0,
            prefill_timeout_s=0.5, kv_lookup_timeout_s=0.5))
        yield router
    finally:
        if router is not None:
            await router.stop()
        await engine.stop(0.5)


async def generate(router) -> list[int]:
    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT),
                                     params=pb.SamplingParams(max_tokens=MAX_TOKENS,
                                                              temperature=0, ignore_eos=True))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as ch:
        msgs = [m async for m in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=30)]
    return [t for m in msgs for t in m.token_ids]


@pytest.fixture(scope="module")
def reference():
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return offline_engine().generate([PROMPT], params)[0].token_ids


def count(router, name, **labels) -> float:
    return router.state.metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_retry_once_then_whole_prompt_to_decode(reference):
    torch.set_num_threads(1)

    async def main():
        async with broken_prefill("down") as (a, down), broken_prefill("slow") as (b, slow), \
                router_over([a, b]) as router:
            tokens = await generate(router)
            return tokens, router, down.calls, slow.calls

    tokens, router, down_calls, slow_calls = asyncio.run(asyncio.wait_for(main(), 90))
    assert tokens == reference
    assert (down_calls, slow_calls) == (1, 1)  # one try each: the first, then the retry
    assert count(router, "pdserve_router_prefill_retries_total") == 1
    assert count(router, "pdserve_router_prefill_failures_total", code="UNAVAILABLE") == 1
    assert count(router, "pdserve_router_prefill_failures_total",
                 code="DEADLINE_EXCEEDED") == 1
    assert count(router, "pdserve_router_prefill_fallbacks_total") == 1
    assert count(router, "pdserve_router_kv_lookup_failures_total") == 1  # nobody at the store


def test_bad_input_at_prefill_is_the_clients_error():
    torch.set_num_threads(1)

    async def main():
        async with broken_prefill("bad") as (a, bad), router_over([a]) as router:
            try:
                await generate(router)
            except grpc.aio.AioRpcError as err:
                return err, router, bad.calls
            raise AssertionError("the request should have failed")

    err, router, calls = asyncio.run(asyncio.wait_for(main(), 90))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "broken prefill" in err.details()
    assert calls == 1
    assert count(router, "pdserve_router_prefill_retries_total") == 0
    assert count(router, "pdserve_router_prefill_fallbacks_total") == 0
