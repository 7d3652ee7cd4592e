"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, health, metrics.

A request's engine work lives exactly as long as its client: a disconnect while waiting for
the instance, while streaming, or while a non-streaming answer is computed cancels the JobRun,
which aborts the requests in their engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pdserve.services.common.convert import MAX_REQUEST_ID_CHARS
from pdserve.services.router.api.deadline import deadline_for, within
from pdserve.services.router.api.errors import APIError, bad_request
from pdserve.services.router.api.http_edge import EdgeMiddleware, install_error_handlers
from pdserve.services.router.dispatch.job_run import JobRun
from pdserve.services.router.api.request_meta import meta_from_headers
from pdserve.services.router.api.router_tracing import request_span
from pdserve.services.router.api.openai_jobs import chat_job, completion_job
from pdserve.services.router.api.prompts import OFF_LOOP_BODY_BYTES
from pdserve.services.router.api.openai_protocol import (ChatCompletionRequest,
                                                        CompletionRequest, check_fields)
from pdserve.services.router.api.responses import (ChatFormat, CompletionFormat, collect,
                                               new_meta, stream_events)
from pdserve.services.router.state import RouterState


class ClientGone(Exception):
    """The HTTP client disconnected before we answered."""


class _RunResponse(StreamingResponse):
    """Closes its JobRun however the response ends, even if the stream never started, and
    counts the request in flight while it streams (here rather than in one more async
    generator around the stream, which every token would pass through)."""

    def __init__(self, run: JobRun, content, state: RouterState, **kw):
        super().__init__(content, **kw)
        self._run = run
        self._state = state

    async def __call__(self, scope, receive, send):
        self._state.metrics.in_flight.inc()
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._state.metrics.in_flight.dec()
            self._run.close()


def build_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(EdgeMiddleware, metrics=state.metrics,
                       max_body_bytes=state.config.limits.max_body_bytes,
                       max_in_flight=state.config.limits.http_max_concurrency)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await _generate(request, state, "/v1/completions", CompletionRequest,
                               completion_job, CompletionFormat, "cmpl")

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await _generate(request, state, "/v1/chat/completions", ChatCompletionRequest,
                               chat_job, ChatFormat, "chatcmpl")

    @app.get("/v1/models")
    async def models():
        card = {"id": state.config.model_name, "object": "model", "created": 0,
                "owned_by": "pdserve", "max_model_len": state.pool.max_model_len,
                "vocab_size": state.tokenizer.vocab_size}  # token ids must be below it
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        up, total = len(state.pool.healthy), len(state.pool.backends)
        body = {"status": "ok" if up else "unavailable", "healthy_instances": up,
                "instances": total}
        if state.config.worker_index >= 0:  # one of several router workers: which one
            body["worker"] = state.config.worker_index
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    app.openapi = _openapi(app)
    return app


_REF = "#/components/schemas/{model}"


def _body_schema(model) -> dict:
    """The request body in /openapi.json (the routes parse it themselves, to answer every
    malformed body in OpenAI's shape); its nested models go to components (_openapi)."""
    schema = model.model_json_schema(ref_template=_REF)
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": schema}}}}


def _openapi(app: FastAPI):
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                comps.update(model.model_json_schema(ref_template=_REF).get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema
    return openapi


async def _generate(request: Request, state: RouterState, endpoint: str, body_type, job_fn,
                    form_type, prefix: str) -> Response:
    arrival = time.monotonic()
    try:
        headers = request.headers
        meta = meta_from_headers(headers.get, state.config.routing.affinity_header,
                                 client=request.client.host if request.client else "")
        if state.gate is not None:
            meta = state.gate.identify(meta)  # before reading what an unknown caller sent
        body = await _parse(request, body_type)
        job = await build_job(job_fn, body, state, len(await request.body()))
        if state.gate is not None:
            job = state.gate.isolate(job, meta)
        meta = dataclasses.replace(meta, affinity=meta.affinity or body.user or None)
        deadline = deadline_for(arrival, state.config.limits.request_timeout_s)
        with request_span(f"router.{endpoint}", headers):
            run = await _until_disconnect(request, within(state.start_run(job, meta, arrival),
                                                          deadline))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        meta = new_meta(prefix, body.model or state.config.model_name,
                        bool(body.logprobs is not None and body.logprobs is not False),
                        include_usage)
        form = form_type.create(meta, state.text_of, body, state.tokenizer)
        if body.stream:
            response = _RunResponse(run, stream_events(run, form, deadline), state,
                                    media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})
        else:
            response = JSONResponse(await _until_disconnect(request, _counted(
                collect(run, form, deadline), state)))
    except APIError as err:
        retry = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
        response = JSONResponse(err.to_json(), status_code=err.status, headers=retry)
    except ClientGone:
        response = Response(status_code=499)  # nobody reads it; nginx's "client closed"
    echo = request.headers.get("x-request-id")
    if echo and len(echo) <= MAX_REQUEST_ID_CHARS:
        response.headers["x-request-id"] = echo
    return response  # counted by EdgeMiddleware, with every other response


async def build_job(job_fn, body, state: RouterState, body_bytes: int):
    """`job_fn(body, state, id)`, our id (a client's is only echoed). A large body (a long
    prompt) builds it on a worker thread: its tokenization releases the GIL
    (prompts.encode_text), so the loop streams other requests' tokens meanwhile."""
    request_id = uuid.uuid4().hex
    if body_bytes < OFF_LOOP_BODY_BYTES:
        return job_fn(body, state, request_id)
    return await asyncio.to_thread(job_fn, body, state, request_id)


async def _parse(request: Request, body_type):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer can take
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("request body holds an unpaired UTF-16 surrogate (like \\ud800): "
                          "strings must be valid Unicode") from None
    data = check_fields(data, body_type)  # refused and unknown fields: 400 naming them
    try:
        return body_type.model_validate(data)
    except ValidationError as exc:
        # Wrong shape (missing or mistyped field): 422; out-of-range values are 400 later;
        # an unknown field inside a message: 400 naming it.
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: '{param}'",
                              param=param, code="unknown_parameter") from None
        raise bad_request(f"{param}: {first['msg']}", param=param, status=422) from None


async def _until_disconnect(request: Request, work):
    """Awaits `work` (a coroutine or async generator's result) unless the client leaves first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()  # our own cancellation, or the client left: stop the work
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    # The body is read already, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _counted(work, state: RouterState):
    """Counts the request in flight while the coroutine `work` runs (a streamed answer is
    counted by _RunResponse)."""
    async def coro():
        state.metrics.in_flight.inc()
        try:
            return await work
        finally:
            state.metrics.in_flight.dec()
    return coro()
