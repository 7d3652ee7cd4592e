"""The router's limits on what a client controls: sizes, counts, time. Each is documented in
docs/hardening.md with its flag; every one refuses with a clear 4xx (gRPC: INVALID_ARGUMENT or
RESOURCE_EXHAUSTED), never a 5xx."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class LimitsConfig:
    max_body_bytes: int = 4 * MIB  # an HTTP request body; more -> 413
    max_stop_chars: int = 1024  # per stop string
    max_stop_token_ids: int = 256
    max_user_chars: int = 256  # OpenAI's `user`
    max_salt_chars: int = 256  # `cache_salt`
    max_logprobs: int = 20  # logprobs / top_logprobs
    # The total time a request may take at the router, queueing and streaming included; past
    # it the request is aborted in its engines and the client gets 504 (or an error event when
    # tokens were already streamed). 0: no deadline.
    request_timeout_s: float = 600.0
    # uvicorn: connections served at once (more get 503), how long an idle keep-alive
    # connection stays open, how long a client may take to send its request head, and the
    # largest request head (request line + headers).
    http_max_concurrency: int = 2048
    http_keep_alive_s: float = 5.0
    http_header_timeout_s: float = 10.0
    http_max_header_bytes: int = 64 * 1024
    # gRPC (the router's API, and the engines' servers): the largest message each way and the
    # RPCs served at once (more get RESOURCE_EXHAUSTED).
    grpc_max_message_bytes: int = 4 * MIB
    grpc_max_concurrent_rpcs: int = 2048

    def __post_init__(self):
        for name in ("max_body_bytes", "max_stop_chars", "max_user_chars", "max_salt_chars",
                     "http_max_concurrency", "http_max_header_bytes", "grpc_max_message_bytes",
                     "grpc_max_concurrent_rpcs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_stop_token_ids <= 1024:
            raise ValueError(f"max_stop_token_ids must be in [0, 1024], got "
                             f"{self.max_stop_token_ids}")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be in [0, 20], got {self.max_logprobs}")
        if self.request_timeout_s < 0:
            raise ValueError(f"request_timeout_s must be >= 0, got {self.request_timeout_s}")
        if self.http_keep_alive_s <= 0 or self.http_header_timeout_s <= 0:
            raise ValueError("http_keep_alive_s and http_header_timeout_s must be > 0")
