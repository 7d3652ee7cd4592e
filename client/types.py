"""The client's typed values: what a caller passes in and gets back (no protobuf in sight)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import grpc


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # cancelled


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | user | assistant
    content: str

    def __post_init__(self):
        if not self.role:
            raise ValueError("a chat message needs a role")


@dataclass(frozen=True)
class Sampling:
    """Sampling settings; None leaves a field to the server's default (the engine's)."""

    max_tokens: Optional[int] = None
    temperature: Optional[float] = None  # 0 -> greedy
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # 0 or -1 -> disabled
    min_p: Optional[float] = None
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None  # top-N alternatives per token; 0 -> the chosen one only
    min_tokens: int = 0

    def __post_init__(self):
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) alternatives, best first


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Chunk:
    """One streamed delta. The last one has `finish_reason` and `usage` set."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: Optional[FinishReason] = None
    usage: Optional[Usage] = None
    breakdown: dict[str, float] = field(default_factory=dict)  # last chunk: where time went, s


@dataclass(frozen=True)
class Completion:
    """A whole generation: the chunks joined."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()
    breakdown: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RouterHealth:
    serving: bool
    healthy_backends: int
    total_backends: int


class ClientError(Exception):
    """A call the router refused or failed: the gRPC status and the server's message (a bad
    request is INVALID_ARGUMENT, an unknown model NOT_FOUND, overload RESOURCE_EXHAUSTED)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
