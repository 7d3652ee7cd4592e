"""Prometheus metrics of one engine instance (prefill, decode or unified), in its own registry.

Names follow vLLM's where the meaning is the same, so dashboards built for vLLM work:

  vllm:num_requests_running / vllm:num_requests_waiting     gauges, from EngineStats
  vllm:kv_cache_usage_perc                                   gauge, fraction 0..1 as in vLLM
  vllm:prefix_cache_queries / vllm:prefix_cache_hits         counters, in tokens
  vllm:num_preemptions                                       counter
  vllm:prompt_tokens / vllm:generation_tokens                counters (tokens this instance
                                                             took in / sampled and sent)
  vllm:time_to_first_token_seconds                           histogram: RPC arrival -> first
                                                             token this instance sends
  vllm:inter_token_latency_seconds                           histogram (see observe_itl)
  vllm:e2e_request_latency_seconds                           histogram: RPC arrival -> last
  vllm:request_queue_time_seconds                            histogram: arrival -> scheduled,
                                                             less any KV load wait

and ours, for what vLLM has no name for:

  pdserve_num_requests_waiting_for_kv                        gauge
  pdserve_kv_transfer_bytes{direction=save|load}             counter
  pdserve_kv_transfer_blocks{direction=save|load}            counter
  pdserve_kv_transfer_seconds{direction=save|load}           counter (I/O thread time)
  pdserve_kv_transfer_failures{kind=save|load|lookup}        counter
  pdserve_kv_load_recomputes                                 counter: loads that ended in
                                                             recomputation (engine's count)
  pdserve_kv_store_hit_tokens                                counter: prompt tokens loaded
                                                             from the store instead of computed
  pdserve_kv_store_hit_requests                              counter: requests that loaded any

Every series carries `model_name` (as vLLM's do). Gauges and cumulative counters are read from
the engine at scrape time by a collector (nothing runs per step); histograms are observed by
the services once per request or per streamed message.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, CONTENT_TYPE_PLAIN_0_0_4

# vLLM's buckets, so histogram_quantile over a mixed fleet lines up
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (EngineStats, ConnectorStats or None); both read-only snapshots or plain counters
StatsSource = Callable[[], tuple]


class EngineMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, stats_source: Optional[StatsSource] = None):
        """`stats_source()` -> (EngineStats, ConnectorStats | None), called at each scrape;
        None -> only the histograms and token counters (tests, engines not started yet)."""
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "RPC arrival to the first token this instance sent",
                              labels, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive tokens this instance sent",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "RPC arrival to the request's last token", labels,
                             buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "RPC arrival to first scheduled, less any KV load wait",
                                    labels, buckets=_REQUEST_BUCKETS, registry=r
                                    ).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests served",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Tokens this instance sampled and sent", labels,
                                         registry=r).labels(model_name)
        self.store_hit_tokens = Counter("pdserve_kv_store_hit_tokens",
                                        "Prompt tokens loaded from the KV store instead of "
                                        "computed", labels, registry=r).labels(model_name)
        self.store_hit_requests = Counter("pdserve_kv_store_hit_requests",
                                          "Requests that loaded KV from the store", labels,
                                          registry=r).labels(model_name)
        if stats_source is not None:
            r.register(_EngineCollector(model_name, stats_source))

    def observe_itl(self, gap_s: float, num_tokens: int) -> None:
        """One streamed message of `num_tokens` tokens, `gap_s` after the previous one: one
        observation of the mean gap (a slow reader's merged message is not expanded into a
        Python call per token; the mean stays right, the count is per message)."""
        if num_tokens > 0:
            self.itl.observe(gap_s / num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int) -> ThreadingHTTPServer:
        """GET /metrics on host:port from a daemon thread; `shutdown()` + `server_close()` stop
        it. Always the classic text format: prometheus_client's own server answers a scraper
        that accepts OpenMetrics (Prometheus does by default) with every ':' in a name turned
        into '_', so `vllm:time_to_first_token_seconds` would arrive as
        `vllm_time_to_first_token_seconds` and vLLM dashboards would find nothing."""
        server = ThreadingHTTPServer((host, port), _handler(self.render, CONTENT_TYPE_PLAIN_0_0_4))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        return server


def _handler(render: Callable[[], bytes], content_type: str):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = render()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # one line per scrape is noise
            pass

    return Handler


class _EngineCollector:
    """Reads the engine's stats snapshot at scrape time (the scrape runs on the HTTP server's
    thread; EngineStats is replaced, never mutated, and the connector's counters are ints)."""

    def __init__(self, model_name: str, source: StatsSource):
        self._model = model_name
        self._source = source

    def describe(self):
        return []  # no describe-time call into the engine; names are checked at collect

    def collect(self):
        stats, kv = self._source()
        m = [self._model]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch",
                    stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                    stats.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage: 1 means 100 percent",
                    stats.kv_usage)
        yield gauge("pdserve_num_requests_waiting_for_kv",
                    "Requests parked while their KV loads from the store",
                    stats.num_waiting_for_kv)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache", stats.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      stats.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Requests preempted", stats.num_preemptions)
        yield counter("pdserve_kv_load_recomputes", "KV loads that failed and were recomputed",
                      stats.num_kv_load_failures)
        if kv is None:
            return
        for name, doc, unit, pairs in (
                ("pdserve_kv_transfer_bytes", "KV bytes moved to / from the store", "direction",
                 (("save", kv.bytes_saved), ("load", kv.bytes_loaded))),
                ("pdserve_kv_transfer_blocks", "KV blocks moved to / from the store",
                 "direction", (("save", kv.blocks_saved), ("load", kv.blocks_loaded))),
                ("pdserve_kv_transfer_seconds", "Seconds the KV I/O thread spent saving / "
                 "loading", "direction", (("save", kv.save_seconds), ("load", kv.load_seconds))),
                ("pdserve_kv_transfer_failures", "Failed KV saves, loads and store lookups",
                 "kind", (("save", kv.save_failures), ("load", kv.load_failures),
                          ("lookup", kv.lookup_failures)))):
            c = CounterMetricFamily(name, doc, labels=["model_name", unit])
            for label, value in pairs:
                c.add_metric([self._model, label], value)
            yield c
