"""Where a request's time went, as the server reports it in its final streamed message.

The contract with the services: the last SSE chunk of a stream (the usage chunk when
`stream_options.include_usage` is set) may carry a top-level object under `BREAKDOWN_KEY`,
and the final gRPC `GenerateResponse` may carry a `breakdown` message or map, with any of the
fields below in seconds. Missing fields were not measured (colocated mode has no KV save or
load); unknown fields are ignored so services can add more without breaking older benches.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping, Optional, Sequence

from pdserve.bench.stats import summarize

BREAKDOWN_KEY = "pdserve_breakdown"


@dataclass(frozen=True)
class LatencyBreakdown:
    router_queue_s: Optional[float] = None  # arrival at the router -> sent to an instance
    prefill_queue_s: Optional[float] = None  # accepted by prefill -> scheduled
    prefill_compute_s: Optional[float] = None  # prompt forward passes, first token sampled
    kv_save_s: Optional[float] = None  # prefill -> store, not hidden behind compute
    kv_load_s: Optional[float] = None  # store -> decode, request parked in WAITING_FOR_KV
    decode_queue_s: Optional[float] = None  # accepted by decode -> first decode step
    decode_compute_s: Optional[float] = None  # decode steps until finished

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and v < 0:
                raise ValueError(f"breakdown {f.name} must be >= 0, got {v!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_json(cls, obj: Mapping) -> "LatencyBreakdown":
        names = cls.field_names()
        return cls(**{k: float(v) for k, v in obj.items() if k in names and v is not None})

    def to_json(self) -> dict:
        return {n: getattr(self, n) for n in self.field_names() if getattr(self, n) is not None}


def aggregate_breakdowns(items: Sequence[Mapping]) -> dict:
    """{field: Summary json} over the requests that reported that field; {} when none did."""
    out = {}
    for name in LatencyBreakdown.field_names():
        values = [float(b[name]) for b in items if b and b.get(name) is not None]
        if values:
            out[name] = summarize(values).to_json()
    return out
