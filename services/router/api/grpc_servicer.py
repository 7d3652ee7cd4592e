"""The Router gRPC API: Generate streams the same deltas the HTTP API sends as SSE."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from pdserve.common.rpc import router_pb2 as pb
from pdserve.common.rpc import router_pb2_grpc as pb_grpc
from pdserve.services.common.convert import (FINISH_FROM_PROTO, MAX_REQUEST_ID_CHARS,
                                             logprob_to_proto, params_from_proto)
from pdserve.services.router.api.deadline import deadline_for, iterate_within, within
from pdserve.services.router.api.errors import APIError, bad_request
from pdserve.services.router.dispatch.job import Choice, Job
from pdserve.services.router.api.prompts import (OFF_LOOP_BODY_BYTES, chat_prompt,
                                                 check_length, encode_text)
from pdserve.services.router.api.request_meta import (grpc_peer_host, meta_from_headers,
                                                      metadata_getter)
from pdserve.services.router.api.router_tracing import request_span
from pdserve.services.router.api.sampling import check_params, check_token_ids
from pdserve.services.router.state import RouterState

log = logging.getLogger(__name__)
_FINISH_TO_PROTO = {r.value: code for code, r in FINISH_FROM_PROTO.items() if r is not None}


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, state: RouterState):
        self._state = state

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.monotonic()
        status = "OK"
        metadata = context.invocation_metadata()
        deadline = deadline_for(arrival, self._state.config.limits.request_timeout_s)
        try:
            meta = meta_from_headers(metadata_getter(metadata),
                                     self._state.config.routing.affinity_header,
                                     client=grpc_peer_host(context.peer() or ""))
            if request.ByteSize() < OFF_LOOP_BODY_BYTES:
                job = self._job(request)
            else:  # a long prompt: tokenized on a worker thread, GIL released (encode_text)
                job = await asyncio.to_thread(self._job, request)
            gate = self._state.gate
            if gate is not None:
                meta = gate.identify(meta)
                job = gate.isolate(job, meta)
            with request_span("router.Generate", metadata):
                run = await within(self._state.start_run(job, meta, arrival), deadline)
        except APIError as err:
            status = err.grpc_code.name
            self._count(status)
            await _abort(context, err)
        except Exception as exc:  # a bug, not the client's fault: still a clean status
            log.exception("Generate failed before its stream began")
            self._count(grpc.StatusCode.INTERNAL.name)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        self._state.metrics.in_flight.inc()
        try:
            completion = 0
            async for _, delta in iterate_within(run.deltas(), deadline):
                completion += len(delta.token_ids)
                msg = pb.GenerateResponse(
                    request_id=request.request_id, text=delta.text, token_ids=delta.token_ids,
                    logprobs=[logprob_to_proto(lp) for lp in delta.logprobs])
                if delta.finish_reason is not None:
                    msg.finish_reason = _FINISH_TO_PROTO[delta.finish_reason]
                    msg.usage.CopyFrom(pb.Usage(prompt_tokens=delta.num_prompt_tokens,
                                                completion_tokens=completion,
                                                cached_tokens=delta.num_cached_tokens))
                    msg.breakdown.update(delta.breakdown or {})
                yield msg
        except APIError as err:
            status = err.grpc_code.name
            await _abort(context, err)
        except Exception as exc:
            log.exception("Generate failed while streaming")
            status = grpc.StatusCode.INTERNAL.name
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        finally:
            run.close()  # also when the client cancelled: aborts in the engine
            self._state.metrics.in_flight.dec()
            self._count(status)

    async def Health(self, request, context):
        pool = self._state.pool
        up = len(pool.healthy)
        return pb.RouterHealthResponse(serving=up > 0, healthy_backends=up,
                                       total_backends=len(pool.backends))

    def _count(self, status: str) -> None:
        self._state.metrics.requests.labels("grpc:Generate", status).inc()

    def _job(self, request: pb.GenerateRequest) -> Job:
        state = self._state
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise bad_request(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters",
                              param="request_id")
        state.check_model(request.model)
        kind = request.WhichOneof("input")
        limits = state.config.limits
        if kind == "text":
            ids = encode_text(state.tokenizer, request.text)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
            check_token_ids(ids, state.vocab_size, "input")
        elif kind == "chat":
            msgs = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            ids = chat_prompt(msgs, state.tokenizer)
        else:
            raise bad_request("set one of text, token_ids or chat", param="input")
        if not ids:
            raise bad_request("prompt must not be empty", param="input")
        check_length([ids], state.pool.max_model_len, "input")
        salt = request.cache_salt if request.HasField("cache_salt") else None
        if len(request.params.stop) > state.config.max_stop:
            raise bad_request(f"stop may list at most {state.config.max_stop} strings",
                              param="stop")
        try:
            params = params_from_proto(request.params, salt)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from None
        check_params(params, limits, state.vocab_size)
        # Our own id, always: a caller's request_id is only echoed back (see the proto).
        return Job(uuid.uuid4().hex, (Choice(0, tuple(ids), params),), salt)



async def _abort(context: grpc.aio.ServicerContext, err: APIError) -> None:
    if err.retry_after is not None:
        context.set_trailing_metadata((("retry-after", str(err.retry_after)),))
    await context.abort(err.grpc_code, err.message)
