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


# The label values the router's labelled counters take. Each series is created at 0 up front
# (Prometheus' advice for known label sets), so a dashboard's rate() over, say, fallbacks shows
# 0 before the first one rather than no data.
FALLBACK_RUNGS = ("prefill_retry", "prefill_to_unified", "decode_retry", "error_after_tokens")
ADMISSION_REJECTIONS = ("queue_full", "tokens_full", "shed", "slo", "rate_limit",
                        "queue_timeout", "unauthorized")
DISAGG_DECISIONS = ("prefill", "stored", "short", "prefill_busy", "no_prefill")
PREFILL_SKIPS = ("stored", "short")


class RouterMetrics:
    """The router's own series (`pdserve_*`): what clients see (TTFT, ITL and end-to-end at the
    router, requests by endpoint and status), routing, the fallback ladder, admission and the
    instances' state as the router last polled it. The engines' `vllm:*` series are on each
    engine's own /metrics (`--metrics-port`), not here."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "Requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        # Latency per priority tier (the request's x-priority after the key's cap, an integer
        # in [-1000, 1000]): what SLO experiments split; sum by (le) for all tiers.
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Request arrival to first generated token, by priority tier",
                              ["priority"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds",
                             "Time between consecutive generated tokens, by priority tier",
                             ["priority"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds",
                             "Request arrival to last token, by priority tier", ["priority"],
                             buckets=_E2E_BUCKETS, registry=r)
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

        self._disaggregation(r)
        self._routing(r)
        for hist in (self.ttft, self.itl, self.e2e):
            hist.labels("0")  # the default tier's series exist before its first request
        for counter, values in ((self.fallbacks, FALLBACK_RUNGS),
                                (self.admission_rejected, ADMISSION_REJECTIONS),
                                (self.disagg_decisions, DISAGG_DECISIONS),
                                (self.prefill_skipped, PREFILL_SKIPS)):
            for value in values:
                counter.labels(value)

    def _disaggregation(self, r: CollectorRegistry) -> None:
        """Routing decisions and fallbacks of disaggregated mode, and the instances' KV
        transfer counters (mirrored from their GetLoad, hence gauges)."""
        self.prefill_skipped = Counter(
            "pdserve_router_prefill_skipped", "Requests sent straight to decode: every full "
            "prompt block stored (stored) or too few uncached tokens (short)", ["reason"],
            registry=r)
        self.prefill_retries = Counter(
            "pdserve_router_prefill_retries",
            "Prefill calls retried on another instance after an error or timeout", registry=r)
        self.prefill_failures = Counter(
            "pdserve_router_prefill_failures", "Prefill calls that failed, by gRPC code",
            ["code"], registry=r)
        self.prefill_fallbacks = Counter(
            "pdserve_router_prefill_fallbacks", "Requests sent whole to a decode instance "
            "because no prefill instance could compute them", registry=r)
        self.kv_lookups = Counter("pdserve_router_kv_lookups",
                                  "Prefix lookups at the KV store master", registry=r)
        self.kv_lookup_failures = Counter(
            "pdserve_router_kv_lookup_failures",
            "Prefix lookups that failed (the store was unreachable or too slow)", registry=r)
        self.kv_lookup_hit_tokens = Counter(
            "pdserve_router_kv_lookup_hit_tokens",
            "Prompt tokens the store already held when the router asked", registry=r)
        self.instance_kv_blocks = Gauge(
            "pdserve_instance_kv_blocks", "KV blocks an instance saved to / loaded from the "
            "store since it started", ["instance", "direction"], registry=r)
        self.instance_kv_bytes = Gauge(
            "pdserve_instance_kv_bytes", "KV bytes an instance saved to / loaded from the "
            "store since it started", ["instance", "direction"], registry=r)
        self.instance_kv_seconds = Gauge(
            "pdserve_instance_kv_seconds", "Seconds an instance spent saving / loading KV",
            ["instance", "direction"], registry=r)
        self.instance_kv_failures = Gauge(
            "pdserve_instance_kv_failures", "An instance's failed KV saves, loads (each one "
            "recomputed) and store lookups since it started", ["instance", "kind"], registry=r)

    def _routing(self, r: CollectorRegistry) -> None:
        """Routing decisions, the fallback ladder's rungs, breakers and admission."""
        self.routed = Counter("pdserve_router_routed", "Calls routed, by instance kind and "
                              "instance", ["kind", "instance"], registry=r)
        self.disagg_decisions = Counter(
            "pdserve_router_disagg_decisions", "Where a prompt was computed: prefill "
            "(on a prefill instance) or a reason decode computed it (stored, short, "
            "prefill_busy, no_prefill)", ["decision"], registry=r)
        self.fallbacks = Counter(
            "pdserve_router_fallback_rungs", "Fallback ladder steps taken: prefill_retry, "
            "prefill_to_unified, decode_retry, error_after_tokens", ["rung"], registry=r)
        self.migrations = Counter(
            "pdserve_router_migrations", "Streams moved to another decode instance after "
            "theirs failed mid-stream, by outcome (ok, failed, limit)", ["outcome"], registry=r)
        self.breaker_opened = Counter(
            "pdserve_router_breaker_opened", "Times an instance's circuit breaker opened",
            ["instance"], registry=r)
        self.admission_rejected = Counter(
            "pdserve_router_admission_rejected", "Requests refused at admission: queue_full, "
            "tokens_full, shed (a higher priority took its place), slo (TTFT target "
            "unreachable), rate_limit, queue_timeout, unauthorized", ["reason"], registry=r)
        self.admission_queued = Gauge("pdserve_router_admission_queued",
                                      "Requests waiting for a dispatch slot", registry=r)
        self.admission_prefilling = Gauge(
            "pdserve_router_admission_prefilling",
            "Requests dispatched that have no first token yet", registry=r)
        self.prefill_rate = Gauge("pdserve_router_prefill_tokens_per_second",
                                  "Measured prompt tokens computed per second (the TTFT "
                                  "estimate's rate)", registry=r)

    def observe_instance_kv(self, instance: str, kv) -> None:
        """kv: an instance's KVTransferStats message."""
        for direction, blocks, nbytes, secs in (
                ("save", kv.blocks_saved, kv.bytes_saved, kv.save_seconds),
                ("load", kv.blocks_loaded, kv.bytes_loaded, kv.load_seconds)):
            self.instance_kv_blocks.labels(instance, direction).set(blocks)
            self.instance_kv_bytes.labels(instance, direction).set(nbytes)
            self.instance_kv_seconds.labels(instance, direction).set(secs)
        for kind, n in (("save", kv.save_failures), ("load", kv.load_failures),
                        ("lookup", kv.lookup_failures)):
            self.instance_kv_failures.labels(instance, kind).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
