"""The blocking client: one gRPC channel to a router, calls from any thread."""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

import grpc

from pdserve.client import convert
from pdserve.client.types import Chunk, Completion, RouterHealth, Sampling
from pdserve.common.rpc import router_pb2 as pb
from pdserve.common.rpc import router_pb2_grpc as pb_grpc


class Client:
    """`Client("127.0.0.1:50050")`: the router's gRPC API (`pdserve router --grpc-port`).

    `timeout_s` bounds each whole call (a stream included); `channel` replaces the insecure
    channel this makes (pass a `grpc.secure_channel` for TLS). Use as a context manager or call
    `close()`."""

    def __init__(self, address: str, timeout_s: float = 600.0,
                 channel: Optional[grpc.Channel] = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._channel = channel or grpc.insecure_channel(address)
        self._stub = pb_grpc.RouterStub(self._channel)
        self._timeout_s = timeout_s

    def stream(self, prompt: Optional[str] = None, *, token_ids: Optional[Sequence[int]] = None,
               messages: Optional[Iterable[convert.Message]] = None,
               sampling: Sampling = Sampling(), model: str = "", request_id: str = "",
               cache_salt: Optional[str] = None) -> Iterator[Chunk]:
        """Generates from exactly one of a prompt, token ids or chat messages, yielding deltas
        as they come. Leaving the loop early cancels the request on the server.
        Raises ClientError for a refused or failed call."""
        req = convert.request(prompt, token_ids, messages, sampling, model, request_id,
                              cache_salt)
        call = self._stub.Generate(req, timeout=self._timeout_s)
        try:
            for msg in call:
                yield convert.chunk(msg)
        except grpc.RpcError as exc:
            raise convert.error(exc) from None
        finally:
            call.cancel()  # a no-op once the stream has ended

    def generate(self, prompt: Optional[str] = None, **kw) -> Completion:
        """`stream()` joined into one Completion (same arguments)."""
        joiner = convert.Joiner()
        for c in self.stream(prompt, **kw):
            joiner.add(c)
        return joiner.result()

    def health(self) -> RouterHealth:
        try:
            r = self._stub.Health(pb.RouterHealthRequest(), timeout=min(self._timeout_s, 10))
        except grpc.RpcError as exc:
            raise convert.error(exc) from None
        return RouterHealth(r.serving, r.healthy_backends, r.total_backends)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
