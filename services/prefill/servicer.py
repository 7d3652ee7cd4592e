"""PrefillService: computes a prompt and its first token on this instance's engine.

Until the KV store lands (next issue) the prompt's KV stays in this engine's prefix cache and
`block_keys` comes back empty; a decode instance then has nothing to load and says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import grpc

from pdserve.common.engine.outputs import FinishReason
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.services.common.async_engine import AsyncEngine, EngineDeadError
from pdserve.services.common.convert import (FINISH_TO_PROTO, logprob_to_proto,
                                             params_from_proto)
from pdserve.services.common.health import InstanceInfo, health_response, load_response
from pdserve.services.common.request_stream import merge_outputs


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, engine: AsyncEngine, info: InstanceInfo):
        self._engine = engine
        self._info = info

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        salt = request.cache_salt if request.HasField("cache_salt") else None
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        try:
            params = params_from_proto(request.params, salt)
            one = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
            stream = await self._engine.submit(request.request_id or uuid.uuid4().hex,
                                               list(request.prompt_token_ids), one)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {exc}")
        try:
            out = None
            async for piece in stream:
                out = piece if out is None else merge_outputs(out, piece)
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine failed: {exc}")
        finally:
            stream.close()
        if out is None or not out.new_token_ids:
            await context.abort(grpc.StatusCode.ABORTED, "request ended before its first token")
        reason = out.finish_reason
        if reason == FinishReason.LENGTH and params.max_tokens > 1:
            reason = None  # only our max_tokens=1 ended it: decode goes on
        elapsed = loop.time() - arrival
        return pb.PrefillResponse(
            first_token_id=out.new_token_ids[0], text=out.new_text,
            logprob=logprob_to_proto(out.logprobs[0]) if out.logprobs else None,
            finish_reason=FINISH_TO_PROTO[reason], num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            timings=pb.Timings(queue_s=stream.accepted_at - arrival, ttft_s=elapsed,
                               e2e_s=elapsed))

    async def Health(self, request, context):
        return health_response(self._engine, self._info)

    async def GetLoad(self, request, context):
        return load_response(self._engine)
