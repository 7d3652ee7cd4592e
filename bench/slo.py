"""Per-tier service-level objectives and whether one request met them.

A request meets its tier's SLO when it finished without error and each set bound holds:
TTFT <= ttft_s, TPOT <= tpot_s, and ITL <= itl_s, where ITL is either the request's own p99
gap (`itl_mode="p99"`) or every gap (`itl_mode="every"`). ITL is checked on its own because a
request whose average (TPOT) is fine can still stall for seconds mid-stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from pdserve.bench.record import RequestRecord
from pdserve.bench.stats import percentile

ANY_TIER = "*"  # the SLO for tiers that have none of their own
ITL_MODES = ("p99", "every")


@dataclass(frozen=True)
class TierSLO:
    tier: str
    ttft_s: Optional[float] = None
    itl_s: Optional[float] = None
    tpot_s: Optional[float] = None
    itl_mode: str = "p99"

    def __post_init__(self):
        if not self.tier:
            raise ValueError("slo tier must be a non-empty name")
        for name in ("ttft_s", "itl_s", "tpot_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"slo {self.tier}: {name} must be > 0, got {v!r}")
        if self.itl_mode not in ITL_MODES:
            raise ValueError(f"slo {self.tier}: itl_mode must be one of {ITL_MODES}, "
                             f"got {self.itl_mode!r}")

    def to_json(self) -> dict:
        return {"tier": self.tier, "ttft_s": self.ttft_s, "itl_s": self.itl_s,
                "tpot_s": self.tpot_s, "itl_mode": self.itl_mode}


def parse_slo(spec: str) -> TierSLO:
    """'TIER:ttft=2,itl=0.5,tpot=0.2,itl_mode=every' (seconds) -> TierSLO."""
    tier, _, rest = spec.partition(":")
    keys = {"ttft": "ttft_s", "itl": "itl_s", "tpot": "tpot_s", "itl_mode": "itl_mode"}
    kw: dict = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key.strip() not in keys:
            raise ValueError(f"slo {spec!r}: expected key=value with key in {sorted(keys)}")
        name = keys[key.strip()]
        kw[name] = value.strip() if name == "itl_mode" else float(value)
    return TierSLO(tier.strip(), **kw)


def slo_for(tier: str, slos: Mapping[str, TierSLO]) -> TierSLO:
    """The tier's own SLO, else the '*' one, else no bounds (only errors fail)."""
    return slos.get(tier) or slos.get(ANY_TIER) or TierSLO(tier)


def request_itl(record: RequestRecord, mode: str) -> Optional[float]:
    """The ITL figure compared with the bound: the p99 gap or the worst gap."""
    if not record.itl_s:
        return None
    return max(record.itl_s) if mode == "every" else percentile(record.itl_s, 99)


def meets_slo(record: RequestRecord, slo: TierSLO) -> bool:
    if not record.ok:
        return False
    if slo.ttft_s is not None and record.ttft_s > slo.ttft_s:
        return False
    tpot = record.tpot_s
    if slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:
        return False
    itl = request_itl(record, slo.itl_mode)
    return slo.itl_s is None or itl is None or itl <= slo.itl_s
