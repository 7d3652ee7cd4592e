"""DecodeService: streams a request's tokens from the engine; a cancelled call aborts it.

A request may continue a prefill done elsewhere: with `first_token_id` the engine appends that
token (already delivered to the client) and streams only what follows; `block_keys` name the
prompt blocks stored in the KV store, which the engine's consumer connector loads instead of
computing them. Whatever cannot be loaded (missing, corrupt, store down, no store at all) is
recomputed here, so the tokens are the same either way.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.services.common.async_engine import AsyncEngine, EngineDeadError
from pdserve.services.common.convert import output_to_proto, params_from_proto
from pdserve.services.common.health import InstanceInfo, health_response, load_response


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, engine: AsyncEngine, info: InstanceInfo):
        self._engine = engine
        self._info = info

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        salt = request.cache_salt if request.HasField("cache_salt") else None
        first = request.first_token_id if request.HasField("first_token_id") else None
        kv_params = {"block_keys": list(request.block_keys)} if request.block_keys else None
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        try:
            params = params_from_proto(request.params, salt)
            stream = await self._engine.submit(request.request_id or uuid.uuid4().hex,
                                               list(request.prompt_token_ids), params,
                                               first_token_id=first, kv_params=kv_params)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {exc}")
        try:
            timings = pb.Timings(queue_s=stream.accepted_at - arrival)
            yield pb.DecodeResponse(timings=timings)  # accepted: the caller may stop waiting
            async for out in stream:
                msg = output_to_proto(out)
                if out.new_token_ids and not timings.ttft_s:
                    timings.ttft_s = loop.time() - arrival
                    timings.compute_s = loop.time() - stream.accepted_at
                if out.finished:
                    timings.e2e_s = loop.time() - arrival
                    msg.timings.CopyFrom(timings)
                yield msg
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine failed: {exc}")
        finally:
            stream.close()  # a cancelled call lands here: abort in the engine

    async def Health(self, request, context):
        return health_response(self._engine, self._info)

    async def GetLoad(self, request, context):
        return load_response(self._engine)
