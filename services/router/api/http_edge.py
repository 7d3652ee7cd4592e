"""The HTTP edge every request crosses before and after a route: the body size limit, OpenAI-
shaped errors for whatever the routes do not answer themselves (FastAPI's 404 / 405 /
validation errors, an unexpected exception), and one count per response by route and status.

`EdgeMiddleware` is plain ASGI (no BaseHTTPMiddleware): it sees every response's status as it
starts, streamed ones included, and it is outermost, so nothing escapes it as plain text.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.api.errors import APIError

log = logging.getLogger(__name__)

ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                    "/metrics"})
_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
          422: "invalid_value"}


def error_body(status: int, message: str, type_: str = "invalid_request_error",
               param=None, code=None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param,
                                 "code": code}}).encode()


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes",
                    code="request_too_large")


def install_error_handlers(app: FastAPI) -> None:
    """FastAPI's own errors in OpenAI's shape."""
    from fastapi.responses import JSONResponse

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        status = exc.status_code
        type_ = "invalid_request_error" if status < 500 else "internal_error"
        body = {"error": {"message": str(exc.detail), "type": type_, "param": None,
                          "code": _CODES.get(status)}}
        return JSONResponse(body, status_code=status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        body = {"error": {"message": f"{param}: {first.get('msg', 'invalid')}",
                          "type": "invalid_request_error", "param": param,
                          "code": "invalid_value"}}
        return JSONResponse(body, status_code=422)


class EdgeMiddleware:
    def __init__(self, app, metrics: RouterMetrics, max_body_bytes: int,
                 max_in_flight: int = 2048):
        self.app = app
        self.metrics = metrics
        self.max_body = max_body_bytes
        self.max_in_flight = max_in_flight  # requests being answered; more get a 503
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        started = []

        async def counted_send(message):
            if message["type"] == "http.response.start":
                started.append(message["status"])
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        if self.in_flight >= self.max_in_flight:
            body = error_body(503, "the router is answering as many requests as it may; retry "
                              "shortly", "service_unavailable", code="too_many_connections")
            return await _answer(counted_send, 503, body, retry_after=1)
        self.in_flight += 1
        try:
            await self._serve(scope, receive, counted_send, started)
        finally:
            self.in_flight -= 1

    async def _serve(self, scope, receive, counted_send, started):
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body:
            return await _answer(counted_send, 413, error_body(
                413, too_large(self.max_body).message, code="request_too_large"))
        seen = 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise too_large(self.max_body)  # the routes answer it as a 413
            return message

        try:
            await self.app(scope, bounded_receive, counted_send)
        except APIError as err:  # raised outside a route's own handling (the body limit)
            if started:
                raise
            await _answer(counted_send, err.status, json.dumps(err.to_json()).encode())
        except Exception:
            log.exception("unhandled error on %s", scope["path"])
            if started:
                raise  # the response began: nothing sane can be sent now
            await _answer(counted_send, 500, error_body(
                500, "the server failed to answer this request", "internal_error",
                code="internal_error"))


def _content_length(scope):
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _answer(send, status: int, body: bytes, retry_after=None) -> None:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
