"""The child process of `pdserve bench router`: `n` instant fake instances and a router over
them on one event loop; prints one JSON line {"router": gRPC address, "direct": a fake's
address} and serves until its stdin closes (so it never outlives the bench)."""

from __future__ import annotations

import asyncio
import json
import sys


async def serve(n: int, policy: str) -> None:
    from pdserve.bench.router_fakes import FakeInstance
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.router.routing.routing_config import RoutingConfig
    from pdserve.services.router.server import start_router

    fakes = [await FakeInstance.start() for _ in range(n)]
    router = await start_router(RouterConfig(
        model="fake", backends=tuple(f.address for f in fakes), port=0, grpc_port=0,
        routing=RoutingConfig(decode_policy=policy)), tokenizer=object())
    print(json.dumps({"router": f"127.0.0.1:{router.grpc_port}",
                      "direct": fakes[0].address}), flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await router.stop()
        for f in fakes:
            await f.stop()


if __name__ == "__main__":
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    asyncio.run(serve(int(sys.argv[1]), sys.argv[2]))
