"""Engine /metrics: vLLM-compatible names, values read from the engine at scrape time."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.engine.outputs import EngineStats
from pdserve.common.telemetry.engine_metrics import EngineMetrics
from pdserve.connector.store_connector import ConnectorStats


def _samples(metrics: EngineMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            key = (s.name,) + tuple(sorted((k, v) for k, v in s.labels.items()
                                           if k != "model_name"))
            assert s.labels.get("model_name") == "m"
            out[key] = s.value
    return out


def _stats(**kw):
    base = dict(num_running=3, num_waiting=2, kv_usage=0.25, num_waiting_tokens=40,
                num_free_blocks=6, num_total_blocks=8, prefix_cache_queries=100,
                prefix_cache_hits=64, num_preemptions=1, num_waiting_for_kv=1,
                num_kv_load_failures=2)
    base.update(kw)
    return EngineStats(**base)


def test_gauges_and_counters_follow_the_engine():
    state = {"stats": _stats(), "kv": None}
    m = EngineMetrics("m", stats_source=lambda: (state["stats"], state["kv"]))
    s = _samples(m)
    assert s[("vllm:num_requests_running",)] == 3
    assert s[("vllm:num_requests_waiting",)] == 2
    assert s[("vllm:kv_cache_usage_perc",)] == 0.25
    assert s[("vllm:prefix_cache_queries_total",)] == 100
    assert s[("vllm:prefix_cache_hits_total",)] == 64
    assert s[("vllm:num_preemptions_total",)] == 1
    assert s[("pdserve_num_requests_waiting_for_kv",)] == 1
    assert s[("pdserve_kv_load_recomputes_total",)] == 2
    assert not any(k[0].startswith("pdserve_kv_transfer") for k in s)  # no connector

    state["stats"] = _stats(num_running=0, prefix_cache_hits=80)
    state["kv"] = ConnectorStats(blocks_saved=4, bytes_saved=4096, save_seconds=0.5,
                                 blocks_loaded=2, bytes_loaded=2048, load_seconds=0.25,
                                 load_failures=1, lookup_failures=3)
    s = _samples(m)
    assert s[("vllm:num_requests_running",)] == 0
    assert s[("vllm:prefix_cache_hits_total",)] == 80
    assert s[("pdserve_kv_transfer_bytes_total", ("direction", "save"))] == 4096
    assert s[("pdserve_kv_transfer_bytes_total", ("direction", "load"))] == 2048
    assert s[("pdserve_kv_transfer_blocks_total", ("direction", "load"))] == 2
    assert s[("pdserve_kv_transfer_seconds_total", ("direction", "save"))] == 0.5
    assert s[("pdserve_kv_transfer_failures_total", ("kind", "load"))] == 1
    assert s[("pdserve_kv_transfer_failures_total", ("kind", "lookup"))] == 3
    assert s[("pdserve_kv_transfer_failures_total", ("kind", "save"))] == 0


def test_histograms_and_itl_per_message():
    m = EngineMetrics("m")  # no engine: histograms and token counters only
    m.ttft.observe(0.2)
    m.observe_itl(0.3, 3)  # a merged message of 3 tokens: one observation of the mean gap
    m.observe_itl(0.5, 0)  # no tokens: nothing
    m.generation_tokens.inc(4)
    s = _samples(m)
    assert s[("vllm:time_to_first_token_seconds_count",)] == 1
    assert s[("vllm:time_to_first_token_seconds_bucket", ("le", "0.25"))] == 1
    assert s[("vllm:time_to_first_token_seconds_bucket", ("le", "0.1"))] == 0
    assert s[("vllm:inter_token_latency_seconds_count",)] == 1
    assert abs(s[("vllm:inter_token_latency_seconds_sum",)] - 0.1) < 1e-9
    assert s[("vllm:generation_tokens_total",)] == 4
    assert ("vllm:num_requests_running",) not in s
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:prompt_tokens_total", "pdserve_kv_store_hit_tokens_total"):
        assert s[(name,)] == 0


def test_two_instances_in_one_process_do_not_collide():
    a, b = EngineMetrics("m"), EngineMetrics("m")
    a.ttft.observe(1.0)
    assert _samples(b)[("vllm:time_to_first_token_seconds_count",)] == 0
