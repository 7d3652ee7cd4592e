"""OpenTelemetry tracing: one trace per request across router -> prefill -> store -> decode.

The trace context travels in gRPC metadata as W3C `traceparent` / `tracestate` entries.

API (all a service needs):

    tracing = setup_tracing("pdserve-router", otlp_endpoint=args.otlp_endpoint)
    ...
    # incoming call (gRPC servicer or HTTP handler): a SERVER span, child of the caller's
    with server_span("Decode", context.invocation_metadata(), tracer=tracing.tracer,
                     request_id=rid) as span:
        ...
    # outgoing call: a CLIENT span, its context injected into the call's metadata
    with client_span("prefill", tracer=tracing.tracer, instance=addr):
        await stub.Prefill(req, metadata=inject_metadata(metadata))
    # a phase timed after the fact (queueing, compute, KV save/load), explicit timestamps
    record_span("decode.queue", start_ns, end_ns, parent=span, tracer=tracing.tracer)
    ...
    tracing.shutdown()  # flushes what is still buffered

Where spans go, chosen by `setup_tracing`:
  - `exporter=`: an injected exporter (tests: InMemorySpanExporter), exported synchronously;
  - `otlp_endpoint=` or env OTEL_EXPORTER_OTLP_ENDPOINT: OTLP/gRPC, batched off the hot path;
  - env PDSERVE_TRACE_FILE=path: one JSON object per finished span, appended to that file
    (exporters are per process: tests assemble cross-process chains from these files).
With none of them tracing is off: no SDK provider is installed, spans are the API's no-op
ones, and server spans still pass the caller's context through to outgoing calls.

`tracer=None` everywhere means the global tracer, i.e. the provider the last
`setup_tracing(..., set_global=True)` of this process installed (the OpenTelemetry API holds
that global, not this module).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import SpanKind, Status, StatusCode

TRACE_FILE_ENV = "PDSERVE_TRACE_FILE"
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_TRACER_NAME = "pdserve"
_log = logging.getLogger(__name__)


@dataclass
class Tracing:
    """What `setup_tracing` built. `provider` is None when tracing is off."""

    tracer: trace.Tracer
    provider: Any = None  # opentelemetry.sdk.trace.TracerProvider

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def force_flush(self, timeout_ms: int = 5000) -> None:
        if self.provider is not None:
            self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def setup_tracing(service_name: str, otlp_endpoint: Optional[str] = None, exporter=None, *,
                  trace_file: Optional[str] = None, set_global: bool = True) -> Tracing:
    """Build this process's tracer provider (see the module doc for where spans go).

    `otlp_endpoint` defaults to $OTEL_EXPORTER_OTLP_ENDPOINT and `trace_file` to
    $PDSERVE_TRACE_FILE. `set_global=False` keeps the provider private (tests that build
    several in one process pass `tracer=tracing.tracer` explicitly).
    """
    otlp_endpoint = otlp_endpoint or os.environ.get(OTLP_ENDPOINT_ENV) or None
    trace_file = trace_file or os.environ.get(TRACE_FILE_ENV) or None
    if exporter is None and otlp_endpoint is None and trace_file is None:
        return Tracing(tracer=trace.get_tracer(_TRACER_NAME))

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if trace_file is not None:
        # Simple (synchronous) so a span is in the file the moment it ends: a test reads the
        # file right after the call returns. One short line per span; debugging/tests only.
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
    if otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not otlp_endpoint.startswith("https://")
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=insecure)))
    if set_global:
        trace.set_tracer_provider(provider)
    return Tracing(tracer=provider.get_tracer(_TRACER_NAME), provider=provider)


# --- context in gRPC metadata / HTTP headers ---

class _MetadataGetter(Getter):
    """Reads W3C headers from gRPC metadata (a sequence of (key, value) pairs or Metadatum
    objects, as `invocation_metadata()` returns) or from a mapping of HTTP headers."""

    def get(self, carrier, key: str) -> Optional[list[str]]:
        if carrier is None:
            return None
        if isinstance(carrier, Mapping) or hasattr(carrier, "getlist"):
            getlist = getattr(carrier, "getlist", None)  # starlette Headers: all values
            if getlist is not None:
                return getlist(key) or None
            value = carrier.get(key)
            return None if value is None else [value]
        values = [v for k, v in carrier if k.lower() == key]
        return [v.decode() if isinstance(v, bytes) else v for v in values] or None

    def keys(self, carrier) -> list[str]:
        if carrier is None:
            return []
        if isinstance(carrier, Mapping) or hasattr(carrier, "keys"):
            return list(carrier.keys())
        return [k for k, _ in carrier]


_GETTER = _MetadataGetter()


def extract_context(metadata_or_headers) -> otel_context.Context:
    """The caller's trace context from gRPC metadata or HTTP headers (empty if none)."""
    return propagate.extract(metadata_or_headers, getter=_GETTER)


def inject_metadata(metadata: Optional[Sequence[tuple[str, str]]] = None) -> list:
    """`metadata` plus the current span's W3C trace context, as a new list of (key, value)
    pairs for an outgoing gRPC call. Unchanged (copied) when no span is current."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    out = list(metadata or ())
    out.extend(carrier.items())
    return out


# --- spans ---

def _tracer(tracer: Optional[trace.Tracer]) -> trace.Tracer:
    return tracer if tracer is not None else trace.get_tracer(_TRACER_NAME)


@contextlib.contextmanager
def server_span(name: str, metadata_or_headers=None, *, tracer: Optional[trace.Tracer] = None,
                **attrs) -> Iterator[trace.Span]:
    """A SERVER span around handling one incoming call, child of the caller's span when the
    metadata/headers carry a trace context; current for the block, so calls made inside it
    (inject_metadata) continue the trace. An exception escaping the block marks it ERROR; the
    caller leaving (the call cancelled, a streaming servicer closed) is not an error: the span
    gets `cancelled=true` and one INFO line says so. Safe inside async generators (see
    `_span_scope`)."""
    parent = extract_context(metadata_or_headers)
    span = _tracer(tracer).start_span(name, context=parent, kind=SpanKind.SERVER,
                                      attributes=_clean(attrs))
    with _span_scope(span, parent, name):
        yield span


@contextlib.contextmanager
def client_span(name: str, *, tracer: Optional[trace.Tracer] = None,
                **attrs) -> Iterator[trace.Span]:
    """A CLIENT span around one outgoing call (child of the current span); call
    `inject_metadata` inside the block so the callee's server span is its child."""
    span = _tracer(tracer).start_span(name, kind=SpanKind.CLIENT, attributes=_clean(attrs))
    with _span_scope(span, None, name):
        yield span


# The caller going away: a streaming servicer's generator closed (GeneratorExit) or the call's
# task cancelled. Neither is a failure of ours.
_LEFT = (GeneratorExit, asyncio.CancelledError)


@contextlib.contextmanager
def _span_scope(span: trace.Span, parent: Optional[otel_context.Context],
                name: str) -> Iterator[None]:
    """Makes `span` current for the block and ends it after.

    OpenTelemetry's own `start_as_current_span` detaches with a contextvars token, which only
    the Context that attached it may reset. A streaming gRPC servicer is an async generator:
    when the client disconnects, grpc closes it from another task, so the exit runs in a
    different Context and OpenTelemetry logs `ERROR Failed to detach context` with a
    traceback. Here the reset is tried directly and, from a foreign Context, skipped: that
    Context never saw the attach, and the one that did is finished with the call.
    """
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    try:
        yield
    except _LEFT:
        span.set_attribute("cancelled", True)
        _log.info("%s: the caller left before the call finished", name)
        raise
    except BaseException as exc:
        if span.is_recording():
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()
        _detach(token)


def _detach(token) -> None:
    if not isinstance(token, contextvars.Token):  # another runtime context: its own detach
        otel_context.detach(token)
        return
    try:
        token.var.reset(token)
    except ValueError:  # created in a different Context: nothing of ours is attached here
        pass


def record_span(name: str, start_ns: int, end_ns: int, *, parent: trace.Span,
                tracer: Optional[trace.Tracer] = None, **attrs) -> None:
    """A finished INTERNAL span from timestamps taken earlier (time.time_ns() clock), child
    of `parent`: for phases observed from outside (queueing, compute, KV save/load)."""
    if not parent.is_recording():
        return  # tracing off: skip building a span nobody exports
    ctx = trace.set_span_in_context(parent)
    span = _tracer(tracer).start_span(name, context=ctx, start_time=start_ns,
                                      attributes=_clean(attrs))
    span.end(end_time=max(end_ns, start_ns))


def mark_error(span: trace.Span, message: str) -> None:
    """Mark a span failed without an exception escaping (e.g. a gRPC abort)."""
    span.set_status(Status(StatusCode.ERROR, message))


def _clean(attrs: dict) -> dict:
    """Drop None values: OpenTelemetry refuses them with a warning per call."""
    return {k: v for k, v in attrs.items() if v is not None}


# --- gRPC aio client interceptors: inject the current context into every call ---

def client_interceptors() -> list:
    """Interceptors for `grpc.aio.insecure_channel(addr, interceptors=...)` that add the
    current trace context to every call's metadata (for callers that do not inject by hand;
    a call that already carries `traceparent` keeps its own)."""
    import grpc

    def details_with_context(details):
        md = list(details.metadata or ())
        if any(k == "traceparent" for k, _ in md):
            return details
        return details._replace(metadata=inject_metadata(md))

    class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(details_with_context(details), request)

    class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(details_with_context(details), request)

    return [_UnaryUnary(), _UnaryStream()]


# --- spans as JSON lines in a file ---

class JsonLinesSpanExporter:
    """A SpanExporter appending one JSON object per span to a file:
    {"name", "service", "trace_id", "span_id", "parent_id", "kind", "start_ns", "end_ns",
    "status", "attributes"}; ids in lowercase hex, parent_id null for a root span."""

    def __init__(self, path: str):
        self._path = path
        self._lock = threading.Lock()  # the OTLP batch thread and the loop may both export

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = [json.dumps(span_to_dict(s)) + "\n" for s in spans]
        try:
            with self._lock, open(self._path, "a", encoding="utf-8") as f:
                f.writelines(lines)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_dict(span) -> dict:
    """A finished SDK span (ReadableSpan) as plain data."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


def read_trace_file(path: str) -> list[dict]:
    """The spans a JsonLinesSpanExporter wrote (tests, tools)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
