"""What the prefill and decode servicers report per request: the latency breakdown returned in
the final message, child spans of the RPC's server span, and Prometheus observations.

One `EngineTelemetry` per instance, passed to the servicers (no module state). Both parts are
optional: tracer None -> the process's global tracer (a no-op one unless set up), metrics None
-> nothing observed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdserve.common.telemetry.engine_metrics import EngineMetrics
from pdserve.common.telemetry.tracing import record_span
from pdserve.services.engine_host.phases import Interval, Phases, queue_span, request_phases
from pdserve.services.engine_host.request_timeline import RequestTimeline

PREFILL_RPC = "pdserve.v1.PrefillService/Prefill"
DECODE_RPC = "pdserve.v1.DecodeService/Decode"


@dataclass(frozen=True)
class EngineTelemetry:
    tracer: object = None  # opentelemetry Tracer
    metrics: Optional[EngineMetrics] = None
    kv_store: bool = False  # a KV connector is attached: KV save/load are measured


def finish_prefill(tel: EngineTelemetry, span, tl: RequestTimeline, arrival_ns: int,
                   end_ns: int, num_prompt_tokens: int) -> dict:
    """Records a finished Prefill; returns its breakdown {field: seconds}."""
    phases = request_phases(tl, arrival_ns, end_ns, first_token_ends_compute=True)
    m = tel.metrics
    if m is not None:
        m.ttft.observe((end_ns - arrival_ns) * 1e-9)
        m.e2e.observe((end_ns - arrival_ns) * 1e-9)
        m.prompt_tokens.inc(num_prompt_tokens)
        m.generation_tokens.inc(1)
        _observe_common(m, tl, phases)
    if phases is None:
        return {}
    _spans(tel, span, "prefill", phases, tl)
    out = {"prefill_queue_s": phases.queue_s, "prefill_compute_s": phases.compute.seconds}
    if tel.kv_store:
        out["kv_save_s"] = phases.kv_save.seconds
        if phases.kv_load is not None:  # a stored prefix loaded here (not decode's kv_load_s)
            out["prefill_kv_load_s"] = phases.kv_load.seconds
    return out


def finish_decode(tel: EngineTelemetry, span, tl: RequestTimeline, arrival_ns: int,
                  end_ns: int, num_prompt_tokens: int, num_sent_tokens: int) -> dict:
    """Records a finished Decode stream; returns its breakdown {field: seconds}."""
    phases = request_phases(tl, arrival_ns, end_ns, first_token_ends_compute=False)
    m = tel.metrics
    if m is not None:
        m.e2e.observe((end_ns - arrival_ns) * 1e-9)
        m.prompt_tokens.inc(num_prompt_tokens)
        m.generation_tokens.inc(num_sent_tokens)
        _observe_common(m, tl, phases)
    if phases is None:
        return {}
    _spans(tel, span, "decode", phases, tl)
    out = {"decode_queue_s": phases.queue_s, "decode_compute_s": phases.compute.seconds}
    if phases.kv_load is not None:
        out["kv_load_s"] = phases.kv_load.seconds
    return out


def _observe_common(m: EngineMetrics, tl: RequestTimeline, phases: Optional[Phases]) -> None:
    if phases is not None:
        m.queue_time.observe(phases.queue_s)
    if tl.kv_wait_start_ns and tl.kv_tokens:
        m.store_hit_requests.inc()
        m.store_hit_tokens.inc(tl.kv_tokens)


def _spans(tel: EngineTelemetry, span, role: str, phases: Phases,
           tl: RequestTimeline) -> None:
    if span is None or not span.is_recording():
        return
    tracer = tel.tracer

    def rec(name: str, iv: Optional[Interval], **attrs) -> None:
        if iv is not None:
            record_span(name, iv.start_ns, iv.end_ns, parent=span, tracer=tracer, **attrs)

    rec(f"{role}.queue", queue_span(phases))
    rec(f"{role}.kv_load", phases.kv_load, tokens=tl.kv_tokens)
    rec(f"{role}.compute", phases.compute)
    if tel.kv_store:
        rec(f"{role}.kv_save", phases.kv_save)
