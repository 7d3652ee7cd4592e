"""Client-facing errors: one type carries both the HTTP status and the gRPC code."""

from __future__ import annotations

import math
from typing import Optional

import grpc


class APIError(Exception):
    """An error the client sees, as OpenAI shapes it: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 grpc_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
                 retry_after: Optional[int] = None):
        super().__init__(message)
        self.retry_after = retry_after  # seconds; sent as Retry-After / retry-after metadata
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.grpc_code = grpc_code

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None,
                status: int = 400) -> APIError:
    return APIError(status, message, param=param, code=code)


def context_too_long(prompt_len: int, max_model_len: Optional[int],
                     param: Optional[str] = None) -> APIError:
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens; the prompt has "
        f"{prompt_len} tokens, leaving no room to generate", param=param,
        code="context_length_exceeded")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", param="model",
                    code="model_not_found", grpc_code=grpc.StatusCode.NOT_FOUND)


def unavailable(message: str) -> APIError:
    return APIError(503, message, type_="service_unavailable", code="no_backend",
                    grpc_code=grpc.StatusCode.UNAVAILABLE)


def too_many(message: str, code: str, retry_after: float) -> APIError:
    """429 / RESOURCE_EXHAUSTED: refused now, worth retrying after `retry_after` seconds."""
    return APIError(429, message, type_="rate_limit_error", code=code,
                    grpc_code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                    retry_after=max(1, math.ceil(retry_after)))


def unauthorized() -> APIError:
    return APIError(401, "a valid API key is required: Authorization: Bearer KEY",
                    type_="authentication_error", code="invalid_api_key",
                    grpc_code=grpc.StatusCode.UNAUTHENTICATED)


_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def message_too_large(err: grpc.aio.AioRpcError) -> bool:
    """gRPC refused a message for its size (either side's limit): the request's fault, not
    the instance's, so it must never count against the instance's breaker."""
    return (err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "message larger than max" in (err.details() or ""))


def client_fault(err: grpc.aio.AioRpcError) -> bool:
    """The instance is fine; the request is bad (a 4xx, never an instance failure)."""
    return (err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
            or message_too_large(err))


def from_backend(err: grpc.aio.AioRpcError) -> APIError:
    """A backend's gRPC failure as the client should see it (same code on the gRPC API)."""
    if message_too_large(err):
        return APIError(413, f"the request is too large for the engine: {err.details()}",
                        code="request_too_large", grpc_code=grpc.StatusCode.RESOURCE_EXHAUSTED)
    status, type_ = _FROM_GRPC.get(err.code(), (500, "internal_error"))
    return APIError(status, err.details() or err.code().name, type_=type_,
                    grpc_code=err.code() if status != 500 else grpc.StatusCode.INTERNAL)
