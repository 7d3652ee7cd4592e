"""When requests are sent: Poisson, gamma (bursty), constant rate, or fixed concurrency.

Gamma inter-arrival times with shape `burstiness` and scale 1 / (rate * burstiness) keep the
mean rate at `rate`; burstiness 1 is Poisson, below 1 is burstier, above 1 more regular (as in
vLLM's benchmark). Fixed concurrency has no schedule: N workers each send the next request as
soon as their last one ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

KINDS = ("poisson", "gamma", "constant", "concurrency")


@dataclass(frozen=True)
class ArrivalConfig:
    kind: str = "poisson"
    rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape
    concurrency: int = 0  # 'concurrency' kind: workers; others: a cap (0 = none)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"arrival kind must be one of {KINDS}, got {self.kind!r}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 (inf for all at once), got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.concurrency < 0 or (self.kind == "concurrency" and self.concurrency < 1):
            raise ValueError(f"concurrency must be >= 1 for kind 'concurrency', >= 0 "
                             f"otherwise, got {self.concurrency}")

    def offsets(self, n: int, rng: np.random.Generator) -> Optional[list[float]]:
        """Send times in seconds from the start, or None for fixed concurrency."""
        if self.kind == "concurrency":
            return None
        if math.isinf(self.rate):
            return [0.0] * n
        if self.kind == "constant":
            gaps = np.full(n, 1.0 / self.rate)
        else:
            shape = 1.0 if self.kind == "poisson" else self.burstiness
            gaps = rng.gamma(shape, 1.0 / (self.rate * shape), size=n)
        gaps[0] = 0.0  # the first request goes at once; the rate governs the rest
        return [float(x) for x in np.cumsum(gaps)]

    def describe(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency {self.concurrency}"
        extra = f", burstiness {self.burstiness:g}" if self.kind == "gamma" else ""
        return f"{self.kind} {self.rate:g} req/s{extra}"
