"""Tracing API: context crosses gRPC metadata / HTTP headers, spans chain parent -> child,
recorded phases keep their timestamps, the JSON-lines file holds what the exporter saw."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.common.telemetry.tracing import (client_interceptors, client_span,
                                              extract_context, inject_metadata, read_trace_file,
                                              record_span, server_span, setup_tracing)
from opentelemetry import trace


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("test-svc", exporter=exporter, set_global=False)
    yield tracing, exporter
    tracing.shutdown()


def _by_name(exporter):
    return {s.name: s for s in exporter.get_finished_spans()}


def test_metadata_carries_the_parent(traced):
    tracing, exporter = traced
    with client_span("call", tracer=tracing.tracer, instance="a:1"):
        md = inject_metadata([("x-request-id", "r1")])
    assert md[0] == ("x-request-id", "r1")
    assert [k for k, _ in md[1:]] == ["traceparent"]
    # as grpc's invocation_metadata() hands it over: bytes values are tolerated too
    with server_span("Decode", tuple(md), tracer=tracing.tracer, request_id="r1",
                     skipped=None):
        pass
    spans = _by_name(exporter)
    call, srv = spans["call"], spans["Decode"]
    assert srv.context.trace_id == call.context.trace_id
    assert srv.parent.span_id == call.context.span_id
    assert srv.parent.is_remote
    assert srv.kind == trace.SpanKind.SERVER and call.kind == trace.SpanKind.CLIENT
    assert srv.attributes["request_id"] == "r1" and "skipped" not in srv.attributes
    assert call.attributes["instance"] == "a:1"


def test_http_headers_and_no_context(traced):
    tracing, exporter = traced
    with client_span("c", tracer=tracing.tracer):
        headers = dict(inject_metadata())
    with server_span("http", {"traceparent": headers["traceparent"]}, tracer=tracing.tracer):
        pass
    with server_span("root", None, tracer=tracing.tracer):
        pass
    spans = _by_name(exporter)
    assert spans["http"].parent.span_id == spans["c"].context.span_id
    assert spans["root"].parent is None
    assert inject_metadata() == []  # nothing current: nothing injected


def test_record_span_keeps_timestamps_and_parent(traced):
    tracing, exporter = traced
    with server_span("Prefill", [], tracer=tracing.tracer) as span:
        record_span("prefill.queue", 1_000, 5_000, parent=span, tracer=tracing.tracer)
        record_span("backwards", 9_000, 8_000, parent=span, tracer=tracing.tracer)
    spans = _by_name(exporter)
    q = spans["prefill.queue"]
    assert (q.start_time, q.end_time) == (1_000, 5_000)
    assert q.parent.span_id == spans["Prefill"].context.span_id
    assert spans["backwards"].end_time == 9_000  # never ends before it starts


def test_error_in_server_span_marks_it(traced):
    tracing, exporter = traced
    with pytest.raises(RuntimeError):
        with server_span("boom", [], tracer=tracing.tracer):
            raise RuntimeError("x")
    assert _by_name(exporter)["boom"].status.status_code == trace.StatusCode.ERROR


def test_off_passes_context_through(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("PDSERVE_TRACE_FILE", raising=False)
    off = setup_tracing("off", set_global=False)
    assert not off.enabled
    incoming = [("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]
    with server_span("s", incoming, tracer=off.tracer) as span:
        assert not span.is_recording()
        record_span("ignored", 1, 2, parent=span, tracer=off.tracer)  # a no-op, no error
        out = dict(inject_metadata())
    assert out["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"


def test_trace_file(tmp_path, monkeypatch):
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("PDSERVE_TRACE_FILE", str(path))
    tracing = setup_tracing("file-svc", set_global=False)
    try:
        with server_span("outer", [], tracer=tracing.tracer) as outer:
            record_span("inner", 10, 20, parent=outer, tracer=tracing.tracer, n=3)
    finally:
        tracing.shutdown()
    spans = {s["name"]: s for s in read_trace_file(str(path))}
    assert set(spans) == {"outer", "inner"}
    assert spans["inner"]["parent_id"] == spans["outer"]["span_id"]
    assert spans["inner"]["trace_id"] == spans["outer"]["trace_id"]
    assert spans["outer"]["parent_id"] is None
    assert spans["outer"]["service"] == "file-svc"
    assert spans["inner"]["attributes"] == {"n": 3}
    assert (spans["inner"]["start_ns"], spans["inner"]["end_ns"]) == (10, 20)


def test_client_interceptors_inject(traced):
    """A real grpc.aio call through the interceptors arrives with the caller's context."""
    tracing, exporter = traced
    seen = {}

    async def handler(request, context):
        seen["ctx"] = trace.get_current_span(
            extract_context(context.invocation_metadata())).get_span_context()
        return b"ok"

    async def main():
        server = grpc.aio.server()
        generic = grpc.method_handlers_generic_handler(
            "t.S", {"M": grpc.unary_unary_rpc_method_handler(handler)})
        server.add_generic_rpc_handlers((generic,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(
                    f"127.0.0.1:{port}", interceptors=client_interceptors()) as ch:
                call = ch.unary_unary("/t.S/M")
                with client_span("outgoing", tracer=tracing.tracer) as span:
                    assert await call(b"x", timeout=5) == b"ok"
                    return span.get_span_context()
        finally:
            await server.stop(0)

    sent = asyncio.run(main())
    assert seen["ctx"].trace_id == sent.trace_id
    assert seen["ctx"].span_id == sent.span_id


def test_otlp_export_reaches_a_collector():
    """With an endpoint, spans go out over OTLP/gRPC (here: a fake collector on loopback)."""
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import (trace_service_pb2,
                                                        trace_service_pb2_grpc)

    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tracing = setup_tracing("otlp-svc", otlp_endpoint=f"http://127.0.0.1:{port}",
                                set_global=False)
        assert tracing.enabled
        with server_span("exported", [], tracer=tracing.tracer, request_id="r9"):
            pass
        tracing.shutdown()  # flushes the batch
    finally:
        server.stop(0)
    spans = [(rs, s) for req in received for rs in req.resource_spans
             for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for _, s in spans] == ["exported"]
    service = {a.key: a.value.string_value for a in spans[0][0].resource.attributes}
    assert service["service.name"] == "otlp-svc"


def test_a_streaming_span_closed_from_another_context_logs_no_error(traced, caplog):
    """A streaming servicer is an async generator; when its client leaves, it is closed from
    another task (another contextvars Context). The span still ends, marked cancelled, with an
    INFO line and no `Failed to detach context` ERROR; the closing task's context is untouched."""
    import logging

    tracing, exporter = traced
    caplog.set_level(logging.INFO)

    async def servicer():
        with server_span("Decode", (), tracer=tracing.tracer, request_id="r"):
            while True:
                yield 1

    async def main():
        gen = servicer()
        await gen.__anext__()  # the span is open and current inside the generator's task
        before = trace.get_current_span()
        await asyncio.create_task(gen.aclose())  # closed from another task's Context
        assert trace.get_current_span() is before

    asyncio.run(main())
    span = _by_name(exporter)["Decode"]
    assert span.end_time is not None and span.attributes["cancelled"] is True
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("the caller left" in r.getMessage() for r in caplog.records)
