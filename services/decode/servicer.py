"""DecodeService: streams a request's tokens from the engine; a cancelled call aborts it.

A migrated request carries `resumed_token_ids`, the tokens another instance had streamed
before it failed: the engine continues after them (see EngineCore.add_request).
A request may continue a prefill done elsewhere: with `first_token_id` the engine appends that
token (already delivered to the client) and streams only what follows; `block_keys` name the
prompt blocks stored in the KV store, which the engine's consumer connector loads instead of
computing them. Whatever cannot be loaded (missing, corrupt, store down, no store at all) is
recomputed here, so the tokens are the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import grpc

from pdserve.common.engine.kv_transfer import KVTransferParams
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.common.telemetry.tracing import server_span
from pdserve.services.engine_host.async_engine import (AsyncEngine, EngineDeadError,
                                                       RequestFailedError)
from pdserve.services.common.convert import (EngineLimits, check_engine_request,
                                             output_to_proto, params_from_proto)
from pdserve.services.engine_host.engine_telemetry import DECODE_RPC, EngineTelemetry, finish_decode
from pdserve.services.engine_host.health import InstanceInfo, health_response, load_response


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, engine: AsyncEngine, info: InstanceInfo,
                 telemetry: EngineTelemetry = EngineTelemetry()):
        self._engine = engine
        self._info = info
        self._tel = telemetry
        self._limits = EngineLimits(info.vocab_size, info.max_model_len, info.block_size)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        # a child of the caller's span when the call's metadata carries a trace context
        with server_span(DECODE_RPC, context.invocation_metadata(), tracer=self._tel.tracer,
                         request_id=request.request_id,
                         num_prompt_tokens=len(request.prompt_token_ids),
                         num_block_keys=len(request.block_keys)) as span:
            # aclosing: a cancelled call must run _decode's finally (the engine abort) now,
            # not whenever the inner generator is collected
            async with contextlib.aclosing(self._decode(request, context, span)) as msgs:
                async for msg in msgs:
                    yield msg

    async def _decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext,
                      span):
        salt = request.cache_salt if request.HasField("cache_salt") else None
        first = request.first_token_id if request.HasField("first_token_id") else None
        kv_transfer = None
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        arrival_ns = time.time_ns()
        metrics = self._tel.metrics
        try:
            params = params_from_proto(request.params, salt)
            prompt = list(request.prompt_token_ids)
            check_engine_request(self._limits, request.request_id, prompt, params, first,
                                 request.block_keys)
            if request.block_keys:
                kv_transfer = KVTransferParams(tuple(request.block_keys))
            # The engine's key is ours: a caller's id is only a label (it could name another
            # caller's request).
            stream = await self._engine.submit(uuid.uuid4().hex, prompt, params,
                                               first_token_id=first, kv_transfer=kv_transfer,
                                               resumed_token_ids=tuple(request.resumed_token_ids))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {exc}")
        try:
            timings = pb.Timings(queue_s=stream.accepted_at - arrival)
            yield pb.DecodeResponse(timings=timings)  # accepted: the caller may stop waiting
            last_token_at = None  # loop.time() of the previous message with tokens
            prof = self._engine.profile
            sent = 0
            async for out in stream:
                msg = output_to_proto(out)
                n = len(out.new_token_ids)
                if n:
                    now = loop.time()
                    if last_token_at is None:
                        timings.ttft_s = now - arrival
                        timings.compute_s = now - stream.accepted_at
                        if metrics is not None:
                            metrics.ttft.observe(timings.ttft_s)
                    elif metrics is not None:
                        metrics.observe_itl(now - last_token_at, n)
                    last_token_at = now
                    sent += n
                if out.finished:
                    timings.e2e_s = loop.time() - arrival
                    breakdown = finish_decode(self._tel, span, stream.timeline, arrival_ns,
                                              time.time_ns(), len(request.prompt_token_ids),
                                              sent)
                    timings.breakdown.update(breakdown)
                    msg.timings.CopyFrom(timings)
                t0 = time.perf_counter_ns()
                yield msg  # returns once gRPC wrote it and wants the next
                prof.send_ns += time.perf_counter_ns() - t0
                prof.num_messages += 1
        except RequestFailedError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine failed: {exc}")
        finally:
            stream.close()  # a cancelled call lands here: abort in the engine

    async def Health(self, request, context):
        return health_response(self._engine, self._info)

    async def GetLoad(self, request, context):
        return load_response(self._engine)
