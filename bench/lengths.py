"""Token-length distributions for synthetic prompts and outputs.

Specs: '256' (fixed), 'uniform:128:512' (inclusive), 'normal:256:64' (mean, std),
'exponential:256' (mean). Samples are rounded and clipped to at least 1 token.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

KINDS = ("fixed", "uniform", "normal", "exponential")
_ARITY = MappingProxyType({"fixed": 1, "uniform": 2, "normal": 2, "exponential": 1})


@dataclass(frozen=True)
class LengthDist:
    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"length kind must be one of {KINDS}, got {self.kind!r}")
        if self.a < 1:
            raise ValueError(f"{self.kind} length: first parameter must be >= 1, got {self.a}")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform length: high {self.b} < low {self.a}")
        if self.kind == "normal" and self.b < 0:
            raise ValueError(f"normal length: std must be >= 0, got {self.b}")

    @classmethod
    def parse(cls, spec: str) -> "LengthDist":
        parts = spec.split(":")
        if len(parts) == 1:
            return cls("fixed", float(parts[0]))
        kind, params = parts[0], [float(p) for p in parts[1:]]
        if kind not in _ARITY or len(params) != _ARITY[kind]:
            raise ValueError(f"length spec {spec!r}: expected N, uniform:LO:HI, "
                             "normal:MEAN:STD or exponential:MEAN")
        return cls(kind, *params)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, size=n)
        elif self.kind == "normal":
            x = rng.normal(self.a, self.b, size=n)
        else:
            x = rng.exponential(self.a, size=n)
        return [max(1, int(round(v))) for v in x]

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        tail = f":{self.b:g}" if _ARITY[self.kind] == 2 else ""
        return f"{self.kind}:{self.a:g}{tail}"
