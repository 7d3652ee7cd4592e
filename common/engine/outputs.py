"""Typed results the engine hands to its callers (LLM, services)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # cancelled by the caller


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of the chosen token and the top-N alternatives (token_id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one engine step produced for one request: the tokens since the previous output.

    `new_text` is the detokenized delta (never a broken UTF-8 sequence); a stop string is cut
    from it unless `include_stop_str_in_output`. When `finished`, `finish_reason` is set.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[object] = None  # the stop string or token id that ended it
    logprobs: Optional[list[TokenLogprob]] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0  # total so far
    block_hashes: Optional[list[bytes]] = None  # finished, with a KV connector: prompt blocks
    timeline: Optional[dict[str, float]] = None  # finished: monotonic times, see Request


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of blocks in use, 0..1
    num_waiting_tokens: int  # prompt tokens not yet computed
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_waiting_for_kv: int = 0
    num_kv_load_failures: int = 0  # loads that ended in recomputation


@dataclass
class CompletionOutput:
    """A finished generation, as `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[FinishReason]
    logprobs: Optional[list[TokenLogprob]] = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
