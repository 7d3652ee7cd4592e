"""grpc.health.v1 and server reflection on every pdserve gRPC server, asked through grpcio's own
health and reflection clients: a tiny engine and a router (in this process, so the test can kill
the engine's loop and stop the router) and the KV store master (on the tests' Redis)."""

import asyncio

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def reflected(address: str) -> tuple[list[str], DescriptorPool]:
    channel = grpc.insecure_channel(address)
    db = ProtoReflectionDescriptorDatabase(channel)
    return db.get_services(), DescriptorPool(db)


def request_fields(address: str, message: str) -> set[str]:
    _, pool = reflected(address)  # the pool asks the server lazily: keep it off the loop
    return set(pool.FindMessageTypeByName(message).fields_by_name)


def assert_reflection(address: str, own: dict[str, str]) -> None:
    """`own`: each service the server offers -> one method it must describe."""
    services, pool = reflected(address)
    assert set(own) | {"grpc.health.v1.Health"} <= set(services)
    for service, method in own.items():
        desc = pool.FindServiceByName(service)
        assert method in desc.methods_by_name, (service, list(desc.methods_by_name))


async def checked(address: str, service: str = "") -> int:
    return await asyncio.get_running_loop().run_in_executor(None, check, address, service)


async def in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def test_engine_and_router_health_follow_their_state():
    """A unified tiny engine and a router in this process. Both answer health and reflection;
    the router's open Watch turns NOT_SERVING as its graceful stop begins; the engine answers
    NOT_SERVING once its loop is dead."""
    from pdserve.services.engine_host.engine_server import build_core, start_engine_server
    from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.router.server import start_router

    cfg = EngineServiceConfig(role="unified", port=0, model="tiny", num_blocks=32,
                              max_model_len=256)
    core = build_core(cfg)

    async def main():
        engine = await start_engine_server(cfg, core)
        eaddr = f"127.0.0.1:{engine.port}"
        assert await checked(eaddr) == NOT_SERVING or engine.engine.warmed_up  # warming up
        assert await engine.engine.wait_warmed_up()
        router = await start_router(RouterConfig(model="tiny", backends=(eaddr,), port=0,
                                                 grpc_port=0, health_interval_s=0.2))
        raddr = f"127.0.0.1:{router.grpc_port}"
        for _ in range(100):  # the router's first poll of the engine
            if await checked(raddr) == SERVING:
                break
            await asyncio.sleep(0.1)
        try:
            for address, service in ((raddr, "pdserve.v1.Router"),
                                     (eaddr, "pdserve.v1.DecodeService"),
                                     (eaddr, "pdserve.v1.PrefillService")):
                assert await checked(address) == SERVING
                assert await checked(address, service) == SERVING
            with pytest.raises(grpc.RpcError) as info:
                await checked(eaddr, "pdserve.v1.NoSuchService")
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            await in_thread(assert_reflection, raddr, {"pdserve.v1.Router": "Generate"})
            await in_thread(assert_reflection, eaddr, {"pdserve.v1.DecodeService": "Decode",
                                                       "pdserve.v1.PrefillService": "Prefill"})
            # a reflected descriptor is enough to build a request, as grpcurl does
            fields = await in_thread(request_fields, raddr, "pdserve.v1.GenerateRequest")
            assert {"text", "token_ids", "chat", "params"} <= fields

            async with grpc.aio.insecure_channel(raddr) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                listed = await stub.List(health_pb2.HealthListRequest(), timeout=5)
                assert set(listed.statuses) == {"", "pdserve.v1.Router"}
                watch = stub.Watch(health_pb2.HealthCheckRequest())
                assert (await watch.read()).status == SERVING
                stopping = asyncio.create_task(router.stop())
                assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
                watch.cancel()
                await stopping
            router = None

            engine.engine.stop()  # the engine thread ends: the instance cannot serve
            assert await checked(eaddr) == NOT_SERVING
            assert await checked(eaddr, "pdserve.v1.DecodeService") == NOT_SERVING
        finally:
            if router is not None:
                await router.stop()
            await engine.stop(grace_s=0.5)

    asyncio.run(main())


def test_kvstore_master_answers_health_and_reflection(redis_url):
    from pdserve.services.kvstore.config import MasterConfig
    from pdserve.services.kvstore.master_service import start_master

    async def main():
        master = await start_master(MasterConfig(port=0, redis_url=redis_url))
        address = f"127.0.0.1:{master.port}"
        try:
            assert await checked(address) == SERVING
            assert await checked(address, "pdserve.v1.KVStoreMaster") == SERVING
            await in_thread(assert_reflection, address, {"pdserve.v1.KVStoreMaster": "PutStart"})
        finally:
            await master.stop()

    asyncio.run(main())
