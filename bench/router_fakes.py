"""Instant fake engine instances (gRPC DecodeService + PrefillService) for router tests and
`pdserve bench router`: they answer at once, so what is measured is the router alone.

Lifecycle: `await FakeInstance.start(role)` listens on a free loopback port; `stop()` ends
it. Decode streams `tokens` token ids (the prompt's last id + 1, + 2, ...) after an accepted
message; `calls` counts Decode/Prefill calls it served. `fail_after = n` makes Decode fail
with UNAVAILABLE after its n-th token (an instance dying mid-stream, for the ladder's tests).
A migrated request (`resumed_token_ids`) continues the same sequence after them, as a real
engine's greedy output would.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc

FINGERPRINT = "fake-model"
BLOCK_SIZE = 16


@dataclass
class _State:
    role: str
    tokens: int
    calls: int = 0
    prefixes: set = field(default_factory=set)
    fail_after: int | None = None
    delay_s: float = 0.0  # before the first token
    model: str = "fake"  # the model name Health reports (a router checks it)
    max_model_len: int = 4096  # what Health reports
    request_ids: list = field(default_factory=list)  # of every Decode/Prefill, in order


class _Servicer(pb_grpc.DecodeServiceServicer, pb_grpc.PrefillServiceServicer):
    def __init__(self, state: _State):
        self.s = state

    async def Health(self, request, context):
        return pb.HealthResponse(status=pb.HealthResponse.SERVING, model=self.s.model,
                                 role=self.s.role, max_model_len=self.s.max_model_len, vocab_size=50000,
                                 model_fingerprint=FINGERPRINT, block_size=BLOCK_SIZE)

    async def GetLoad(self, request, context):
        return pb.LoadResponse(num_total_blocks=1024, num_free_blocks=1024)

    async def Decode(self, request, context):
        self.s.calls += 1
        self.s.request_ids.append(request.request_id)
        yield pb.DecodeResponse()  # accepted
        last = request.prompt_token_ids[-1] if request.prompt_token_ids else 0
        n = len(request.prompt_token_ids)
        if self.s.delay_s:
            await asyncio.sleep(self.s.delay_s)
        before = len(request.resumed_token_ids)
        for i in range(before + 1, self.s.tokens + 1):
            if self.s.fail_after is not None and i - before > self.s.fail_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "instance died mid-stream")
            done = i == self.s.tokens
            yield pb.DecodeResponse(
                token_ids=[last + i], text="x", num_prompt_tokens=n, num_output_tokens=i,
                finish_reason=pb.FINISH_REASON_LENGTH if done else pb.FINISH_REASON_UNSPECIFIED)

    async def Prefill(self, request, context):
        self.s.calls += 1
        self.s.request_ids.append(request.request_id)
        last = request.prompt_token_ids[-1] if request.prompt_token_ids else 0
        return pb.PrefillResponse(first_token_id=last + 1, text="x",
                                  num_prompt_tokens=len(request.prompt_token_ids))


class FakeInstance:
    def __init__(self, server: grpc.aio.Server, port: int, state: _State):
        self.server, self.port, self._state = server, port, state
        self.address = f"127.0.0.1:{port}"

    @property
    def calls(self) -> int:
        return self._state.calls

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The request_id of every call it served, in order."""
        return tuple(self._state.request_ids)

    def fail_after(self, tokens: int | None) -> None:
        """Decode streams fail after this many tokens from now on (None: never)."""
        self._state.fail_after = tokens

    @classmethod
    async def start(cls, role: str = "unified", tokens: int = 1,
                    delay_s: float = 0.0, model: str = "fake",
                    max_model_len: int = 4096) -> "FakeInstance":
        """`delay_s`: how long Decode waits before its first token; `model` and
        `max_model_len`: what its Health reports."""
        state = _State(role, tokens, delay_s=delay_s, model=model,
                       max_model_len=max_model_len)
        server = grpc.aio.server()
        servicer = _Servicer(state)
        pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
        pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return cls(server, port, state)

    async def stop(self) -> None:
        await self.server.stop(0)
