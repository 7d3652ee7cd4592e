"""One trace per request across real processes: each service writes its finished spans to the
JSON-lines file named by PDSERVE_TRACE_FILE (exporters are per process) and the test joins
them into parent chains.

Engine side (always): a client span -> Prefill server span (prefill instance) -> its queue,
compute and KV-save phases; the same client span -> Decode server span (decode instance) -> its
KV-load (from the store the prefill filled), queue and compute phases.
Router side: once services/router propagates the trace context (it calls this package's
inject_metadata / client_interceptors), a Generate call's engine spans chain up to the caller's
span through the router; until then they must be roots of traces of their own.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.common.rpc import router_pb2, router_pb2_grpc
from pdserve.common.telemetry.tracing import (client_span, inject_metadata, read_trace_file,
                                              setup_tracing)
from pdserve.tests.integration.disagg_helpers import greedy_params, wait_for
from pdserve.tests.integration.tracing_helpers import engine_stack

ROUTER_SRC = Path(__file__).resolve().parents[2] / "services" / "router"
PREFILL = "pdserve.v1.PrefillService/Prefill"
DECODE = "pdserve.v1.DecodeService/Decode"


def router_propagates() -> bool:
    src = "".join(p.read_text() for p in ROUTER_SRC.rglob("*.py"))
    return "inject_metadata(" in src or "client_interceptors(" in src


def _chain(spans_by_id: dict, span: dict) -> list[dict]:
    """`span` and its ancestors that are in the file, nearest first."""
    out = [span]
    while out[-1]["parent_id"] in spans_by_id:
        out.append(spans_by_id[out[-1]["parent_id"]])
    return out


def _children(spans: list[dict], parent: dict) -> dict:
    return {s["name"]: s for s in spans if s["parent_id"] == parent["span_id"]}


def test_trace_chain_across_processes(tmp_path, monkeypatch):
    trace_file = tmp_path / "spans.jsonl"
    monkeypatch.setenv("PDSERVE_TRACE_FILE", str(trace_file))  # every child inherits it
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    tracing = setup_tracing("test-client", set_global=False)  # this process: the same file
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 go through the store
    try:
        with engine_stack(tmp_path / "logs") as stack:
            with client_span("client", tracer=tracing.tracer) as root:
                md = inject_metadata()
                with grpc.insecure_channel(stack.prefill) as ch:
                    first = pb_grpc.PrefillServiceStub(ch).Prefill(pb.PrefillRequest(
                        request_id="p1", prompt_token_ids=prompt, params=greedy_params(6)),
                        metadata=md, timeout=60)
                with grpc.insecure_channel(stack.decode) as ch:
                    msgs = list(pb_grpc.DecodeServiceStub(ch).Decode(pb.DecodeRequest(
                        request_id="d1", prompt_token_ids=prompt,
                        first_token_id=first.first_token_id, block_keys=first.block_keys,
                        params=greedy_params(6)), metadata=md, timeout=60))
            # spans are written as they end; the decode span ends just after its last message
            wait_for(lambda: sum(s["name"] == DECODE for s in read_trace_file(str(trace_file)))
                     >= 1, 10, "the Decode span in the file")
            check_engine_chain(read_trace_file(str(trace_file)), root, first, msgs)
            check_metrics(stack)

            # the router is started only now: the engine-side chain above stands without it
            _, grpc_addr = stack.start_router()
            with client_span("router-client", tracer=tracing.tracer) as root2:
                req = router_pb2.GenerateRequest(
                    token_ids=router_pb2.TokenIds(ids=list(range(200, 240))),
                    params=greedy_params(4))
                with grpc.insecure_channel(grpc_addr) as ch:
                    gen = list(router_pb2_grpc.RouterStub(ch).Generate(
                        req, metadata=inject_metadata(), timeout=60))
            wait_for(lambda: sum(s["name"] == DECODE
                                 for s in read_trace_file(str(trace_file))) >= 2, 10,
                     "the routed Decode span in the file")
            assert gen[-1].finish_reason == pb.FINISH_REASON_LENGTH
            check_router_chain(read_trace_file(str(trace_file)), root, root2)
    finally:
        tracing.shutdown()


def check_engine_chain(spans: list[dict], root, first, msgs) -> None:
    by_id = {s["span_id"]: s for s in spans}
    root_id, trace_id = (format(root.get_span_context().span_id, "016x"),
                         format(root.get_span_context().trace_id, "032x"))
    assert by_id[root_id]["service"] == "test-client"

    # --- engine side: client -> Prefill -> phases, client -> Decode -> phases
    prefill = [s for s in spans if s["name"] == PREFILL and s["trace_id"] == trace_id]
    decode = [s for s in spans if s["name"] == DECODE and s["trace_id"] == trace_id]
    assert len(prefill) == 1 and len(decode) == 1
    prefill, decode = prefill[0], decode[0]
    assert prefill["service"] == "pdserve-prefill" and decode["service"] == "pdserve-decode"
    assert prefill["parent_id"] == root_id and decode["parent_id"] == root_id
    assert prefill["kind"] == decode["kind"] == "SERVER"
    assert prefill["attributes"]["request_id"] == "p1"
    p_phases = _children(spans, prefill)
    assert {"prefill.queue", "prefill.compute", "prefill.kv_save"} <= set(p_phases)
    d_phases = _children(spans, decode)
    assert {"decode.queue", "decode.kv_load", "decode.compute"} <= set(d_phases)
    assert all(s["trace_id"] == trace_id for s in [*p_phases.values(), *d_phases.values()])
    assert d_phases["decode.kv_load"]["end_ns"] <= d_phases["decode.compute"]["start_ns"]
    assert p_phases["prefill.compute"]["end_ns"] <= p_phases["prefill.kv_save"]["start_ns"]

    # ... and the breakdown those phases gave the final messages
    assert {"prefill_queue_s", "prefill_compute_s", "kv_save_s"} <= set(first.timings.breakdown)
    bd = msgs[-1].timings.breakdown
    assert {"decode_queue_s", "decode_compute_s", "kv_load_s"} <= set(bd)
    assert bd["kv_load_s"] > 0


def _metrics(port: int) -> dict:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def check_metrics(stack) -> None:
    """Each instance's --metrics-port serves its side of the one request."""
    p, d = _metrics(stack.prefill_metrics), _metrics(stack.decode_metrics)
    for m in (p, d):
        assert m[("vllm:time_to_first_token_seconds_count", ())] == 1
        assert m[("vllm:e2e_request_latency_seconds_count", ())] == 1
        assert m[("vllm:num_requests_running", ())] == 0
    assert p[("pdserve_kv_transfer_bytes_total", (("direction", "save"),))] > 0
    assert p[("pdserve_kv_transfer_blocks_total", (("direction", "save"),))] == 2
    assert d[("pdserve_kv_transfer_bytes_total", (("direction", "load"),))] > 0
    assert d[("pdserve_kv_transfer_blocks_total", (("direction", "load"),))] == 2
    assert d[("pdserve_kv_transfer_failures_total", (("kind", "load"),))] == 0
    assert d[("pdserve_kv_store_hit_tokens_total", ())] == 32
    assert d[("pdserve_kv_store_hit_requests_total", ())] == 1
    assert d[("vllm:inter_token_latency_seconds_count", ())] >= 1
    assert d[("vllm:generation_tokens_total", ())] == 5  # the 6th came from prefill


def check_router_chain(spans: list[dict], root, root2) -> None:
    by_id = {s["span_id"]: s for s in spans}
    trace_id = format(root.get_span_context().trace_id, "032x")
    root2_ctx = root2.get_span_context()
    trace2, root2_id = format(root2_ctx.trace_id, "032x"), format(root2_ctx.span_id, "016x")
    served = [s for s in spans if s["name"] == DECODE and s["trace_id"] != trace_id]
    assert len(served) == 1  # the Generate call's Decode
    if router_propagates():
        # client -> router's request span -> its client span -> the engines' server spans
        prefilled = [s for s in spans if s["name"] == PREFILL and s["trace_id"] == trace2]
        assert len(prefilled) == 1  # 40 uncached tokens: the router used the prefill instance
        for rpc in (served[0], prefilled[0]):
            chain = _chain(by_id, rpc)
            assert rpc["trace_id"] == trace2
            assert chain[-1]["span_id"] == root2_id, [s["name"] for s in chain]
            assert any(s["service"] == "pdserve-router" for s in chain)
    else:
        # not yet wired: the engine still traces the request, as the root of its own trace
        assert served[0]["parent_id"] is None and served[0]["trace_id"] != trace2
        assert {"decode.queue", "decode.compute"} <= set(_children(spans, served[0]))
