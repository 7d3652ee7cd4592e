"""The router's tracing hooks, over common/telemetry/tracing.py: a SERVER span where a
request enters (its parent comes from the client's traceparent header / metadata), CLIENT
spans around the Prefill and Decode calls, and the trace context injected into their gRPC
metadata. With tracing off these are the OpenTelemetry API's no-op spans."""

from __future__ import annotations

from pdserve.common.telemetry import tracing


def request_span(name: str, headers_or_metadata, **attrs):
    """Around admission and opening the engine calls (not the streaming that follows, which
    may run in another task)."""
    return tracing.server_span(name, headers_or_metadata, **attrs)


def prefill_span(address: str, request_id: str):
    return tracing.client_span("router.prefill", instance=address, request_id=request_id)


def decode_span(address: str, request_id: str):
    return tracing.client_span("router.decode", instance=address, request_id=request_id)


def outgoing_metadata() -> list:
    """The current span's context as gRPC metadata for an outgoing call."""
    return tracing.inject_metadata()


def setup_router_tracing():
    """Exporters as the environment says (OTEL_EXPORTER_OTLP_ENDPOINT, PDSERVE_TRACE_FILE);
    returns the handle to shut down."""
    return tracing.setup_tracing("pdserve-router")
