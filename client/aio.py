"""The asyncio client: the same calls as `Client`, awaited, on a grpc.aio channel."""

from __future__ import annotations

from typing import AsyncIterator, Iterable, Optional, Sequence

import grpc

from pdserve.client import convert
from pdserve.client.types import Chunk, Completion, RouterHealth, Sampling
from pdserve.common.rpc import router_pb2 as pb
from pdserve.common.rpc import router_pb2_grpc as pb_grpc


class AsyncClient:
    """`async with AsyncClient("127.0.0.1:50050") as c: await c.generate("Hi")`.

    Make it inside the event loop that uses it (grpc.aio channels belong to one loop)."""

    def __init__(self, address: str, timeout_s: float = 600.0,
                 channel: Optional[grpc.aio.Channel] = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._channel = channel or grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.RouterStub(self._channel)
        self._timeout_s = timeout_s

    async def stream(self, prompt: Optional[str] = None, *,
                     token_ids: Optional[Sequence[int]] = None,
                     messages: Optional[Iterable[convert.Message]] = None,
                     sampling: Sampling = Sampling(), model: str = "", request_id: str = "",
                     cache_salt: Optional[str] = None) -> AsyncIterator[Chunk]:
        """As `Client.stream`; breaking out of `async for` cancels the request."""
        req = convert.request(prompt, token_ids, messages, sampling, model, request_id,
                              cache_salt)
        call = self._stub.Generate(req, timeout=self._timeout_s)
        try:
            async for msg in call:
                yield convert.chunk(msg)
        except grpc.RpcError as exc:
            raise convert.error(exc) from None
        finally:
            call.cancel()

    async def generate(self, prompt: Optional[str] = None, **kw) -> Completion:
        joiner = convert.Joiner()
        async for c in self.stream(prompt, **kw):
            joiner.add(c)
        return joiner.result()

    async def health(self) -> RouterHealth:
        try:
            r = await self._stub.Health(pb.RouterHealthRequest(),
                                        timeout=min(self._timeout_s, 10))
        except grpc.RpcError as exc:
            raise convert.error(exc) from None
        return RouterHealth(r.serving, r.healthy_backends, r.total_backends)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
