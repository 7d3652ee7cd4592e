"""Summary statistics of latency samples: mean and the percentiles every report shows.

Percentiles interpolate linearly between order statistics (numpy's default, and vLLM's), so
p50 of [1, 2, 3, 4] is 2.5 and p99 of a 1..100 ramp is 99.01.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

PERCENTILES = (50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linear between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    count: int
    mean: Optional[float]
    p50: Optional[float]
    p90: Optional[float]
    p95: Optional[float]
    p99: Optional[float]

    def to_json(self) -> dict:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary:
    """Mean and percentiles; all None (count 0) when there is nothing to summarize."""
    if not values:
        return Summary(0, None, None, None, None, None)
    p = [percentile(values, q) for q in PERCENTILES]
    return Summary(len(values), sum(values) / len(values), *p)


def median(values: Sequence[float]) -> Optional[float]:
    return percentile(values, 50) if values else None
