"""One request's Decode call to one engine instance, as typed deltas.

Lifecycle: `EngineStream.open(backend, request, ...)` starts the call and returns once the
instance accepted the request (its first, empty message) or raises APIError. Iterate it for
Deltas until one has `finish_reason`; an instance silent for `idle_timeout_s` counts as
failed (504), so a hung instance never hangs the client. That is one timer per stream
(`_IdleWatch`), not one per read: a timer armed and cancelled per streamed token cost ~13 us
of the router's CPU per token. `cancel()` (idempotent, also on
any exit from iteration) cancels the gRPC call, which aborts the request in the engine and
frees its blocks. Picking the instance and retrying elsewhere is decode_open.py's job.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Optional

import grpc

from pdserve.common.engine.outputs import TokenLogprob
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.services.common.convert import FINISH_FROM_PROTO, logprob_from_proto
from pdserve.services.router.routing.backend import Backend
from pdserve.services.router.api.deadline import await_within
from pdserve.services.router.api.errors import APIError, from_backend, unavailable


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


def stream_failed(backend: Backend, why: str, status: int = 502) -> APIError:
    code = grpc.StatusCode.DEADLINE_EXCEEDED if status == 504 else grpc.StatusCode.INTERNAL
    return APIError(status, f"instance {backend.address} {why}", type_="internal_error",
                    grpc_code=code)


class _IdleWatch:
    """Cancels a call whose read has waited `idle_s`: one timer, re-armed only when it fires
    (at most every idle_s), while each read just notes when it began and ended."""

    SLACK_S = 1e-3  # the loop may run a timer up to its clock resolution early

    def __init__(self, call, idle_s: float):
        self._call = call
        self._idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._since: Optional[float] = None  # loop time the pending read began; None: none
        self.fired = False
        self._timer = self._loop.call_at(self._loop.time() + idle_s, self._check)

    def reading(self) -> None:
        self._since = self._loop.time()

    def read_done(self) -> None:
        self._since = None

    def stop(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        since = self._since
        now = self._loop.time()
        if since is not None and now - since >= self._idle_s - self.SLACK_S:
            self.fired = True
            self._call.cancel()  # the pending read raises CancelledError
            return
        self._timer = self._loop.call_at((now if since is None else since) + self._idle_s,
                                         self._check)


class EngineStream:
    def __init__(self, call, backend: Backend, idle_timeout_s: float, queue_s: float = 0.0):
        self._call = call
        self.backend = backend
        self.finished = False
        self._watch = _IdleWatch(call, idle_timeout_s)
        self._queue_s = queue_s  # the instance's arrival -> accepted by its engine

    @classmethod
    async def open(cls, backend: Backend, req: pb.DecodeRequest, idle_timeout_s: float,
                   metadata=None) -> "EngineStream":
        call = backend.decode.Decode(req, metadata=metadata)
        try:
            first = await await_within(call.read(), idle_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise from_backend(err) from None
        except asyncio.TimeoutError:
            call.cancel()
            raise stream_failed(backend, "did not accept the request in time", 504) from None
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise unavailable(f"instance {backend.address} closed the stream")
        return cls(call, backend, idle_timeout_s, first.timings.queue_s)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.finished:
            raise StopAsyncIteration
        self._watch.reading()
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as err:
            self._end()
            if self._watch.fired:
                raise self._silent() from None
            raise from_backend(err) from None
        except asyncio.CancelledError:
            if self._watch.fired:  # the watch cancelled the call, not the task
                self._end()
                raise self._silent() from None
            self.cancel()
            raise
        except BaseException:
            self.cancel()
            raise
        finally:
            self._watch.read_done()
        if msg is grpc.aio.EOF:
            self._end()
            raise stream_failed(self.backend, "ended the stream early")
        delta = delta_from_proto(msg)
        if delta.finish_reason is not None:
            self._end()
            delta = dataclasses.replace(delta, breakdown={
                "decode_queue_s": self._queue_s,
                "decode_compute_s": max(0.0, msg.timings.e2e_s - self._queue_s)})
        return delta

    def _end(self) -> None:
        self.finished = True
        self._watch.stop()

    def _silent(self) -> APIError:
        return stream_failed(self.backend, "stopped sending", 504)

    def cancel(self) -> None:
        self._watch.stop()
        if not self._call.done():
            self._call.cancel()
