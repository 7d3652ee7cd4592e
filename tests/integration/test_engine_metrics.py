"""An engine instance (real tiny EngineCore, in this process) serves /metrics over HTTP with
vLLM's names, returns its latency breakdown in the final message, and records its RPC spans as
children of the caller's span, with queue and compute phases under them."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.common.telemetry.tracing import client_span, inject_metadata, setup_tracing
from pdserve.services.engine_host.engine_server import start_engine_server
from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
from pdserve.services.launcher import free_port

PROMPT = list(range(40, 80))  # 40 tokens: two full blocks of 16, cached after the first call
PARAMS = pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _one(samples: dict, name: str, **labels) -> float:
    want = tuple(sorted({"model_name": "tiny", **labels}.items()))
    return samples[(name, want)]


def test_metrics_breakdown_and_spans_of_one_instance():
    torch.set_num_threads(1)
    from pdserve.common.engine.engine_core import EngineCore

    mport = free_port("127.0.0.1")
    cfg = EngineServiceConfig(role="unified", port=0, model="tiny", num_blocks=64,
                              max_model_len=256, metrics_port=mport)
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("test-engine", exporter=exporter, set_global=False)
    url = f"http://127.0.0.1:{mport}/metrics"

    async def main():
        running = await start_engine_server(cfg, EngineCore(cfg.engine_config()), tracing)
        assert await running.engine.wait_warmed_up()  # SERVING after warm-up
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
                with client_span("client", tracer=tracing.tracer) as root:
                    md = inject_metadata()
                    msgs = [m async for m in pb_grpc.DecodeServiceStub(ch).Decode(
                        pb.DecodeRequest(request_id="d", prompt_token_ids=PROMPT,
                                         params=PARAMS), metadata=md, timeout=60)]
                    first = await pb_grpc.PrefillServiceStub(ch).Prefill(
                        pb.PrefillRequest(request_id="p", prompt_token_ids=PROMPT,
                                          params=PARAMS), metadata=md, timeout=60)
            async with httpx.AsyncClient() as http:
                text = (await http.get(url, timeout=5)).text
            return root, msgs, first, text
        finally:
            await running.stop(1.0)

    try:
        root, msgs, first, text = asyncio.run(main())
    finally:
        tracing.shutdown()

    # the breakdown: decode's and prefill's own fields, tiling their e2e (no store: no KV)
    t = msgs[-1].timings
    assert set(t.breakdown) == {"decode_queue_s", "decode_compute_s"}
    assert t.breakdown["decode_compute_s"] > 0
    assert t.breakdown["decode_queue_s"] + t.breakdown["decode_compute_s"] == \
        pytest.approx(t.e2e_s, abs=0.05)
    pt = first.timings
    assert set(pt.breakdown) == {"prefill_queue_s", "prefill_compute_s"}
    assert pt.breakdown["prefill_compute_s"] > 0
    assert pt.breakdown["prefill_queue_s"] + pt.breakdown["prefill_compute_s"] <= \
        pt.e2e_s + 0.01

    # the spans: RPC server spans are children of the client's, phases children of those
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    decode = by_name["pdserve.v1.DecodeService/Decode"]
    prefill = by_name["pdserve.v1.PrefillService/Prefill"]
    root_ctx = root.get_span_context()
    for rpc in (decode, prefill):
        assert rpc.context.trace_id == root_ctx.trace_id
        assert rpc.parent.span_id == root_ctx.span_id
        assert rpc.kind.name == "SERVER"
    for name, parent in (("decode.queue", decode), ("decode.compute", decode),
                         ("prefill.queue", prefill), ("prefill.compute", prefill)):
        assert by_name[name].parent.span_id == parent.context.span_id, name
    assert by_name["decode.queue"].end_time <= by_name["decode.compute"].start_time
    assert by_name["decode.compute"].end_time <= decode.end_time
    assert decode.attributes["request_id"] == "d"
    assert not any(s.name.endswith(("kv_load", "kv_save")) for s in spans)

    # /metrics over HTTP, vLLM's names
    s = _samples(text)
    assert _one(s, "vllm:time_to_first_token_seconds_count") == 2  # one per RPC
    assert _one(s, "vllm:e2e_request_latency_seconds_count") == 2
    assert _one(s, "vllm:inter_token_latency_seconds_count") == 5  # 6 tokens, 6 messages
    assert _one(s, "vllm:generation_tokens_total") == 6 + 1
    assert _one(s, "vllm:prompt_tokens_total") == 2 * len(PROMPT)
    assert _one(s, "vllm:request_queue_time_seconds_count") == 2
    assert _one(s, "vllm:num_requests_running") == 0
    assert _one(s, "vllm:num_requests_waiting") == 0
    assert 0 <= _one(s, "vllm:kv_cache_usage_perc") < 1
    assert _one(s, "vllm:prefix_cache_hits_total") >= 32  # prefill found decode's 2 blocks
    assert _one(s, "vllm:prefix_cache_queries_total") >= _one(s, "vllm:prefix_cache_hits_total")
    assert not any(n.startswith("pdserve_kv_transfer") for n, _ in s)  # no connector

    # the /metrics server stopped with the instance
    with pytest.raises(httpx.TransportError):
        httpx.get(url, timeout=2)
