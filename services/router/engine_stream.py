"""One request's Decode call to an engine instance, as typed deltas.

Lifecycle: `EngineStream.open()` picks an instance, starts the call and returns once the
instance accepted the request (its first, empty message) or raises APIError, trying the next
instance when one is unreachable. Iterate it for Deltas until one has `finish_reason`.
`cancel()` (idempotent, also on any exit from iteration) cancels the gRPC call, which aborts the
request in the engine and frees its blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import grpc

from pdserve.common.engine.outputs import TokenLogprob
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.common.convert import (FINISH_FROM_PROTO, logprob_from_proto,
                                             params_to_proto)
from pdserve.services.router.backends import Backend, BackendPool
from pdserve.services.router.errors import APIError, from_backend, unavailable


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: Optional[str]  # "stop" | "length" | "abort" on the last delta
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    breakdown: Optional[dict] = None  # last delta: where the time went (bench/breakdown.py)


def delta_from_proto(msg: pb.DecodeResponse) -> Delta:
    reason = FINISH_FROM_PROTO.get(msg.finish_reason)
    return Delta(text=msg.text, token_ids=tuple(msg.token_ids),
                 logprobs=tuple(logprob_from_proto(lp) for lp in msg.logprobs),
                 finish_reason=reason.value if reason is not None else None,
                 num_prompt_tokens=msg.num_prompt_tokens,
                 num_cached_tokens=msg.num_cached_tokens,
                 num_output_tokens=msg.num_output_tokens)


class EngineStream:
    def __init__(self, call, backend: Backend, pool: BackendPool, queue_s: float = 0.0):
        self._call = call
        self.backend = backend
        self._pool = pool
        self.finished = False
        self._queue_s = queue_s  # the instance's arrival -> accepted by its engine

    @classmethod
    async def open(cls, pool: BackendPool, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams, cache_salt: Optional[str] = None,
                   first_token_id: Optional[int] = None,
                   block_keys: tuple[bytes, ...] = ()) -> "EngineStream":
        """`first_token_id`: continue after a token a prefill instance sampled; `block_keys`:
        the prompt blocks the KV store holds, for the instance to load."""
        req = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                               params=params_to_proto(params), cache_salt=cache_salt,
                               first_token_id=first_token_id, block_keys=block_keys)
        tried: tuple[Backend, ...] = ()
        while True:
            backend = pool.pick(exclude=tried)  # raises 503 when none is left
            call = backend.decode.Decode(req)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_backend(err) from None
                pool.report_failure(backend, err.code().name)
                tried += (backend,)
                continue
            except BaseException:
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                raise unavailable(f"instance {backend.address} closed the stream")
            return cls(call, backend, pool, first.timings.queue_s)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.finished:
            raise StopAsyncIteration
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as err:
            self.finished = True
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self._pool.report_failure(self.backend, err.code().name)
            raise from_backend(err) from None
        except BaseException:
            self.cancel()
            raise
        if msg is grpc.aio.EOF:
            self.finished = True
            raise APIError(502, f"instance {self.backend.address} ended the stream early",
                           type_="internal_error", grpc_code=grpc.StatusCode.INTERNAL)
        delta = delta_from_proto(msg)
        if delta.finish_reason is not None:
            self.finished = True
            delta = dataclasses.replace(delta, breakdown={
                "decode_queue_s": self._queue_s,
                "decode_compute_s": max(0.0, msg.timings.e2e_s - self._queue_s)})
        return delta

    def cancel(self) -> None:
        if not self._call.done():
            self._call.cancel()
