"""PrefillService: computes a prompt and its first token on this instance's engine.

With a KV store (role "prefill" -> a producer connector) the engine saves every full prompt
block to the store while it computes, and the request's last output is held back until those
saves are done, so when Prefill answers, a decode instance can load the `block_keys` it
returns. Without a store `block_keys` is empty and a decode instance recomputes the prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import grpc

from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.engine.kv_transfer import KVTransferParams
from pdserve.common.engine.outputs import FinishReason
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.common.telemetry.tracing import server_span
from pdserve.services.engine_host.async_engine import (AsyncEngine, EngineDeadError,
                                                       RequestFailedError)
from pdserve.services.common.convert import (FINISH_TO_PROTO, EngineLimits,
                                             check_engine_request, logprob_to_proto,
                                             params_from_proto)
from pdserve.services.engine_host.engine_telemetry import PREFILL_RPC, EngineTelemetry, finish_prefill
from pdserve.services.engine_host.health import InstanceInfo, health_response, load_response
from pdserve.services.engine_host.request_stream import merge_outputs


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, engine: AsyncEngine, info: InstanceInfo,
                 telemetry: EngineTelemetry = EngineTelemetry()):
        self._engine = engine
        self._info = info
        self._tel = telemetry
        self._limits = EngineLimits(info.vocab_size, info.max_model_len, info.block_size)
        self._tokenizer = engine.core.tokenizer  # read-only: safe off the engine thread

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        # a child of the caller's span when the call's metadata carries a trace context
        with server_span(PREFILL_RPC, context.invocation_metadata(), tracer=self._tel.tracer,
                         request_id=request.request_id,
                         num_prompt_tokens=len(request.prompt_token_ids)) as span:
            return await self._prefill(request, context, span)

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext,
                       span) -> pb.PrefillResponse:
        salt = request.cache_salt if request.HasField("cache_salt") else None
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        arrival_ns = time.time_ns()
        try:
            params = params_from_proto(request.params, salt)
            prompt = list(request.prompt_token_ids)
            check_engine_request(self._limits, request.request_id, prompt, params,
                                 block_keys=request.block_keys)
            one = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
            # the router's store lookup: loaded without asking the store again
            hint = KVTransferParams(tuple(request.block_keys)) if request.block_keys else None
            # The engine's key is ours: a caller's id is only a label (it could name another
            # caller's request).
            stream = await self._engine.submit(uuid.uuid4().hex, prompt, one, kv_transfer=hint)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {exc}")
        try:
            out = None
            async for piece in stream:
                out = piece if out is None else merge_outputs(out, piece)
        except RequestFailedError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine failed: {exc}")
        finally:
            stream.close()  # a cancelled call lands here: abort in the engine
        if out is None or not out.new_token_ids:
            await context.abort(grpc.StatusCode.ABORTED, "request ended before its first token")
        reason = out.finish_reason
        if reason == FinishReason.LENGTH and params.max_tokens > 1:
            reason = None  # only our max_tokens=1 ended it: decode goes on
        now = loop.time()
        breakdown = finish_prefill(self._tel, span, stream.timeline, arrival_ns, time.time_ns(),
                                   len(request.prompt_token_ids))
        text = out.new_text if reason is not None else self._continued_text(out.new_token_ids)
        return pb.PrefillResponse(
            first_token_id=out.new_token_ids[0], text=text,
            logprob=logprob_to_proto(out.logprobs[0]) if out.logprobs else None,
            block_keys=out.block_hashes or [],
            finish_reason=FINISH_TO_PROTO[reason], num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            timings=pb.Timings(queue_s=stream.accepted_at - arrival, ttft_s=now - arrival,
                               e2e_s=now - arrival, compute_s=now - stream.accepted_at,
                               breakdown=breakdown))

    def _continued_text(self, token_ids: list[int]) -> str:
        """The first token's text as an unfinished stream shows it: the engine flushed a
        half UTF-8 character at its artificial end, but the decode instance that goes on
        counts only complete characters as sent, and completes this one with the next."""
        return IncrementalDetokenizer(self._tokenizer).push(token_ids[:1])

    async def Health(self, request, context):
        return health_response(self._engine, self._info)

    async def GetLoad(self, request, context):
        return load_response(self._engine)
