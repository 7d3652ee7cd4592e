"""What one request measured, and how a stream of timestamped chunks becomes that.

ITL is every gap between consecutive token-bearing chunks. When a chunk carries k > 1 tokens
(a gRPC message lists its token ids), its gap is split evenly into k gaps, as SGLang's
benchmark does, so ITL keeps one entry per token after the first chunk. TPOT is the request's
average: (e2e - ttft) / (output_tokens - 1), where output_tokens is the server's usage count
when it sent one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass(frozen=True)
class RequestRecord:
    index: int
    tier: str
    start_s: float  # when it was sent, relative to the run's start
    e2e_s: Optional[float]
    ttft_s: Optional[float]
    itl_s: tuple[float, ...]
    prompt_tokens: int
    output_tokens: int
    error: Optional[str] = None
    breakdown: Optional[dict] = None  # LatencyBreakdown fields the server reported
    text: str = field(default="", repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> Optional[float]:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return {"index": self.index, "tier": self.tier, "start_s": self.start_s,
                "ok": self.ok, "error": self.error, "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s, "e2e_s": self.e2e_s, "itl_s": list(self.itl_s),
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "breakdown": self.breakdown}


def inter_token_gaps(arrivals: Sequence[tuple[float, int]]) -> tuple[float, ...]:
    """Per-token gaps from (time, tokens in that chunk) pairs, the first chunk's time is TTFT."""
    gaps: list[float] = []
    for (prev_t, _), (t, n) in zip(arrivals, arrivals[1:]):
        n = max(n, 1)
        gaps.extend([(t - prev_t) / n] * n)
    return tuple(gaps)


@dataclass
class StreamTrace:
    """Filled in by a client while one request streams; times are time.perf_counter()."""

    sent_t: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    done_t: Optional[float] = None
    usage_prompt: Optional[int] = None
    usage_completion: Optional[int] = None
    breakdown: Optional[dict] = None
    error: Optional[str] = None
    text: str = ""

    def add(self, t: float, tokens: int, text: str = "") -> None:
        self.arrivals.append((t, tokens))
        self.text += text

    def to_record(self, index: int, tier: str, run_start_t: float,
                  prompt_tokens: int) -> RequestRecord:
        first = self.arrivals[0][0] if self.arrivals else None
        error = self.error or (None if first is not None else "no tokens received")
        counted = sum(max(n, 1) for _, n in self.arrivals)
        return RequestRecord(
            index=index, tier=tier, start_s=self.sent_t - run_start_t,
            e2e_s=None if self.done_t is None else self.done_t - self.sent_t,
            ttft_s=None if first is None else first - self.sent_t,
            itl_s=inter_token_gaps(self.arrivals),
            prompt_tokens=self.usage_prompt if self.usage_prompt is not None else prompt_tokens,
            output_tokens=self.usage_completion if self.usage_completion else counted,
            error=error, breakdown=self.breakdown, text=self.text)
