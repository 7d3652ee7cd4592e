"""Per-request sampling settings, validated at construction (ValueError names field and range)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def _require(cond: bool, name: str, allowed: str, value) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 -> disabled
    min_p: float = 0.0
    seed: Optional[int] = None  # same seed, same output
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None  # number of top logprobs per generated token (0 -> only chosen)
    min_tokens: int = 0
    cache_salt: Optional[str] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _require(isinstance(self.max_tokens, int) and self.max_tokens > 0, "max_tokens",
                 "an integer > 0", self.max_tokens)
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(self.top_k == -1 or self.top_k >= 0, "top_k", "-1, 0 (disabled) or > 0",
                 self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(self.repetition_penalty > 0, "repetition_penalty", "> 0",
                 self.repetition_penalty)
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]",
                 self.presence_penalty)
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]",
                 self.frequency_penalty)
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 "non-empty strings", self.stop)
        if self.logprobs is not None:
            _require(0 <= self.logprobs <= 20, "logprobs", "in [0, 20]", self.logprobs)
        _require(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 f"in [0, max_tokens={self.max_tokens}]", self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
