"""Prometheus metrics, each set in its own registry (no process-global state), so two routers
in one test process never collide and `/metrics` shows exactly what its owner registered."""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0)
_E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "Requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Request arrival to first generated token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds",
                             "Time between consecutive generated tokens", buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds",
                             "Request arrival to last token", buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated",
                                         registry=r)
        self.in_flight = Gauge("pdserve_router_requests_in_flight",
                               "Requests the router is serving now", registry=r)
        self.running = Gauge("pdserve_num_requests_running",
                             "Requests running in the engines (sum over healthy instances)",
                             registry=r)
        self.waiting = Gauge("pdserve_num_requests_waiting",
                             "Requests waiting in the engines (sum over healthy instances)",
                             registry=r)
        self.kv_usage = Gauge("pdserve_kv_cache_usage", "Fraction of KV blocks in use",
                              ["instance"], registry=r)
        self.instance_up = Gauge("pdserve_instance_up", "1 when the instance passes health checks",
                                 ["instance"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
