"""Failed requests are said first and loudly: a bench whose requests failed must not read as a
slow server. A banner (count, share, the commonest errors) goes before any table, and the run
exits non-zero when the failed share passes `--max-failed-fraction`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

EXIT_TOO_MANY_FAILED = 3  # 2: the stacks could not start (compare)


@dataclass(frozen=True)
class FailureTally:
    requests: int
    failed: int
    errors: tuple[tuple[str, int], ...] = ()  # (message, count), commonest first

    def __post_init__(self):
        if not 0 <= self.failed <= self.requests:
            raise ValueError(f"failed ({self.failed}) must be in [0, requests "
                             f"({self.requests})]")

    @property
    def fraction(self) -> float:
        return self.failed / self.requests if self.requests else 0.0

    def too_many(self, max_fraction: float) -> bool:
        """Past the threshold; a run with no requests at all counts as failed too."""
        return self.requests == 0 or self.fraction > max_fraction

    def to_json(self) -> dict:
        return {"requests": self.requests, "failed": self.failed,
                "failed_fraction": round(self.fraction, 4),
                "first_errors": [m for m, _ in self.errors[:3]]}


def tally(summaries: Iterable[Mapping]) -> FailureTally:
    """Sums run summaries (summary.summarize_run's dicts: requests, failed, errors)."""
    requests = failed = 0
    errors: Counter = Counter()
    for s in summaries:
        requests += s["requests"]
        failed += s["failed"]
        errors.update(s.get("errors", {}))
    return FailureTally(requests, failed, tuple(errors.most_common(5)))


def banner(t: FailureTally) -> str:
    """'' when nothing failed; else lines that cannot be missed."""
    if not t.failed:
        return ""
    lines = [f"!!! {t.failed} of {t.requests} requests FAILED ({t.fraction:.0%}): the "
             "latency and goodput figures below cover only the rest !!!"]
    lines += [f"!!!   x{n}: {msg[:200]}" for msg, n in t.errors]
    return "\n".join(lines)


def verdict(t: FailureTally, max_fraction: float) -> tuple[dict, int]:
    """The JSON line's failure fields and the exit code."""
    fields = t.to_json()
    if t.too_many(max_fraction):
        fields["error"] = (f"{t.failed} of {t.requests} requests failed, more than "
                           f"--max-failed-fraction {max_fraction:g}")
        return fields, EXIT_TOO_MANY_FAILED
    return fields, 0
