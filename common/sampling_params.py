"""Per-request sampling settings, validated at construction (ValueError names field and range).

Every value a client sends lands here, so the checks bound everything the sampler later turns
into tensors: floats are finite, ints are ints (not bools), token-id lists are short and fit
uint32 (ids past the model's vocabulary are harmless: such a token is never produced, so the
sampler ignores them), and a seed fits the int64 the gRPC messages carry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from pdserve.common.structured_output import StructuredOutput

MAX_STOP_TOKEN_IDS = 1024  # a client cannot make every step scan an unbounded list
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI's own limit is 300)
MAX_BIAS = 100.0  # OpenAI's range for one bias: [-100, 100]
MAX_TOKEN_ID = 2 ** 32 - 1  # proto uint32
GREEDY_TEMPERATURE = 1e-5  # below this, 1/T overflows fp32 arithmetic: treat as greedy


def _require(cond: bool, name: str, allowed: str, value) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 -> disabled
    min_p: float = 0.0
    seed: Optional[int] = None  # same seed, same output (on any path: common/random_stream)
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
    structured_output: Optional[StructuredOutput] = None  # a grammar the output must follow
    # (token id, bias) pairs added to the logits before sampling, sorted by id, ids unique
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check_logit_bias()
        self._check_types()
        _require(self.max_tokens > 0, "max_tokens", "an integer > 0", self.max_tokens)
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(self.top_k == -1 or self.top_k >= 0, "top_k", "-1, 0 (disabled) or > 0",
                 self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        # fp32 logits divided or multiplied by the penalty must stay finite
        _require(1e-6 <= self.repetition_penalty <= 1e6, "repetition_penalty",
                 "in [1e-6, 1e6]", self.repetition_penalty)
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]",
                 self.presence_penalty)
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]",
                 self.frequency_penalty)
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 "non-empty strings", self.stop)
        _require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                 f"at most {MAX_STOP_TOKEN_IDS} ids", len(self.stop_token_ids))
        _require(all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids),
                 "stop_token_ids", f"integers in [0, {MAX_TOKEN_ID}]", self.stop_token_ids)
        if self.seed is not None:
            _require(-2 ** 63 <= self.seed < 2 ** 63, "seed", "in [-2**63, 2**63)", self.seed)
        if self.logprobs is not None:
            _require(0 <= self.logprobs <= 20, "logprobs", "in [0, 20]", self.logprobs)
        _require(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 f"in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        _require(self.structured_output is None
                 or isinstance(self.structured_output, StructuredOutput), "structured_output",
                 "a StructuredOutput or None", self.structured_output)

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            pairs = tuple(sorted((t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got "
                             f"{self.logit_bias!r}") from None
        _require(len(pairs) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} entries",
                 len(pairs))
        _require(all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t, _ in pairs), "logit_bias",
                 f"keyed by token ids in [0, {MAX_TOKEN_ID}]", [t for t, _ in pairs][:8])
        _require(len({t for t, _ in pairs}) == len(pairs), "logit_bias", "keyed by unique ids",
                 "a repeated id")
        _require(all(_is_finite(b) and -MAX_BIAS <= b <= MAX_BIAS for _, b in pairs),
                 "logit_bias", f"biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
                 next((b for _, b in pairs if not (_is_finite(b) and abs(b) <= MAX_BIAS)), None))
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in pairs))

    def _check_types(self) -> None:
        """Types first: NaN fails every comparison and inf passes one-sided bounds, so each
        float must be finite before its range is checked."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_finite(value), name, "a finite number", value)
        for name in ("max_tokens", "top_k", "min_tokens"):
            _require(_is_int(getattr(self, name)), name, "an integer", getattr(self, name))
        for name in ("seed", "logprobs"):
            value = getattr(self, name)
            _require(value is None or _is_int(value), name, "an integer or null", value)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
