"""start_router's `before_listen` hook (where `pdserve serve router` freezes its start-up heap)
runs once everything is built and before either server starts: no request can meet that pass.
The fault matrix reads the freeze's log line once the router answered; the hook used to run
after uvicorn started, and one CI run read the log first.

Only the HTTP port is probed from inside the hook: the hook runs on the event loop, so the aio
gRPC server could not answer there whatever the order (its port is bound, and the kernel would
take the TCP connection either way)."""

import asyncio
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.launcher import free_port
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.server import start_router


def _http_refuses(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _grpc_answers(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            return True
        except grpc.RpcError:
            return False


def test_before_listen_runs_before_the_servers_start():
    http_port, grpc_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    seen = []

    def before_listen():
        seen.append(_http_refuses(http_port))

    async def main():
        router = await start_router(RouterConfig(model="tiny", backends=("127.0.0.1:9",),
                                                 port=http_port, grpc_port=grpc_port),
                                    before_listen=before_listen)
        try:
            assert seen == [True]  # once, and HTTP refused the connection then
            loop = asyncio.get_running_loop()
            assert not await loop.run_in_executor(None, _http_refuses, http_port)
            assert await loop.run_in_executor(None, _grpc_answers, grpc_port)
        finally:
            await router.stop()

    asyncio.run(main())
