"""SLO attainment and goodput, per tier and overall.

Goodput is requests per second that met all of their tier's SLOs, over the run's duration
(DistServe's definition); attainment is the fraction of a tier's requests that met them.
Failed requests count against both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from pdserve.bench.record import RequestRecord
from pdserve.bench.slo import TierSLO, meets_slo, slo_for

OVERALL = "overall"


@dataclass(frozen=True)
class Attainment:
    requests: int
    met: int
    attainment: float  # met / requests
    goodput_rps: float  # met / duration

    def to_json(self) -> dict:
        return asdict(self)


def _attainment(flags: Sequence[bool], duration_s: float) -> Attainment:
    met = sum(flags)
    n = len(flags)
    return Attainment(n, met, met / n if n else 0.0, met / duration_s if duration_s > 0 else 0.0)


def attainment_by_tier(records: Sequence[RequestRecord], slos: Mapping[str, TierSLO],
                       duration_s: float) -> dict[str, Attainment]:
    """{tier: Attainment, ..., 'overall': Attainment}; tiers sorted by name."""
    flags: dict[str, list[bool]] = {}
    for r in records:
        flags.setdefault(r.tier, []).append(meets_slo(r, slo_for(r.tier, slos)))
    out = {t: _attainment(f, duration_s) for t, f in sorted(flags.items())}
    out[OVERALL] = _attainment([x for f in flags.values() for x in f], duration_s)
    return out
