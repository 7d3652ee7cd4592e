"""`pdserve serve router` flags, and the RouterConfig they make."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from pdserve.services.common.tls_args import add_tls_args, tls_from_args
from pdserve.services.router.admission.admission_config import AdmissionConfig
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch.fallback_config import FallbackConfig
from pdserve.services.router.limits_config import LimitsConfig
from pdserve.services.router.routing.routing_config import POLICIES, CostWeights, RoutingConfig


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-prefill-queue-tokens", type=int, default=0,
                   help="decode computes the prompt when every prefill instance has more "
                        "prompt tokens queued than this (0: no limit)")
    p.add_argument("--registry", default="", help="redis://HOST:PORT/DB: instances join "
                   "and leave through the registry (with --kv-store: disaggregated)")
    p.add_argument("--api-key-file", default="", help="one key per line (KEY [tenant=NAME] "
                   "[max_priority=N], docs/hardening.md); requests then need "
                   "Authorization: Bearer KEY (401 otherwise); rate limits are per key, and "
                   "each tenant gets its own prefix cache")
    p.add_argument("--tenant-secret-file", default=RouterConfig.tenant_secret_file,
                   help="the secret that keys tenants' cache salts; routers sharing a cache "
                        "need the same one (default: random per start)")
    p.add_argument("--kv-block-secret-file", default=RouterConfig.kv_block_secret_file,
                   help="the engines' block secret (the store keys prompt blocks by it; "
                        "docs/kvstore-security.md)")
    add_tls_args(p)  # the gRPC API and the channels to the engines and the store master
    r = p.add_argument_group("routing")
    r.add_argument("--decode-policy", choices=POLICIES, default="kv_aware",
                   help="how a decode (or unified) instance is chosen; kv_aware: the most "
                        "cached prefix, then load; round_robin: in turn")
    r.add_argument("--prefill-policy", choices=POLICIES, default="kv_aware",
                   help="how a prefill instance is chosen")
    r.add_argument("--kv-cost-weights", default="", help=_weights_help())
    r.add_argument("--session-affinity", action="store_true",
                   help="the same `user` / affinity header goes to the same instance")
    r.add_argument("--affinity-header", default="x-session-id",
                   help="request header naming the session, with --session-affinity")
    a = p.add_argument_group("admission")
    a.add_argument("--max-prefilling", type=int, default=64,
                   help="requests dispatched without a first token yet; more queue")
    a.add_argument("--max-queued", type=int, default=256,
                   help="requests waiting for admission at most; more: 429")
    a.add_argument("--max-queued-tokens", type=int, default=262144,
                   help="prompt tokens waiting for admission at most; more: 429")
    a.add_argument("--ttft-slo", type=float, default=0.0, help="default TTFT target in "
                   "seconds (x-ttft-slo-ms per request); a request estimated to miss it is "
                   "refused at once (429). 0: none")
    a.add_argument("--prefill-rate", type=float, default=2000.0,
                   help="first guess of prompt tokens/s until measured")
    a.add_argument("--queue-timeout", type=float, default=60.0,
                   help="seconds a request may wait for admission before a 429")
    a.add_argument("--rate-limit-rps", type=float, default=0.0, help="per API key; 0: off")
    a.add_argument("--rate-limit-burst", type=float, default=0.0,
                   help="requests a key may send at once above --rate-limit-rps (0: = rps)")
    a.add_argument("--rate-limit-tokens-per-s", type=float, default=0.0,
                   help="prompt + max tokens per key per second; 0: off")
    a.add_argument("--max-priority", type=int, default=AdmissionConfig.max_priority,
                   help="the highest x-priority a client without an API key gets (keys: "
                        "max_priority= in the key file)")
    lim = p.add_argument_group("limits (docs/hardening.md)")
    d = LimitsConfig()
    lim.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                     help="largest HTTP request body (413 beyond)")
    lim.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                     help="longest stop string")
    lim.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                     help="total seconds a request may take at the router (504 after; 0: none)")
    lim.add_argument("--http-max-concurrency", type=int, default=d.http_max_concurrency,
                     help="HTTP connections and requests served at once (503 beyond)")
    lim.add_argument("--http-keep-alive", type=float, default=d.http_keep_alive_s,
                     help="seconds an idle keep-alive connection stays open")
    lim.add_argument("--http-header-timeout", type=float, default=d.http_header_timeout_s,
                     help="seconds a client has to send its request line and headers")
    lim.add_argument("--grpc-max-message-bytes", type=int, default=d.grpc_max_message_bytes,
                     help="largest gRPC message on the router's API")
    lim.add_argument("--grpc-max-concurrent-rpcs", type=int,
                     default=d.grpc_max_concurrent_rpcs,
                     help="gRPC calls served at once (RESOURCE_EXHAUSTED beyond)")
    f = p.add_argument_group("fallback ladder")
    f.add_argument("--prefill-retries", type=int, default=1,
                   help="other prefill instances tried after a failed Prefill")
    f.add_argument("--decode-retries", type=int, default=1,
                   help="other decode instances tried before the first token")
    f.add_argument("--retry-backoff", type=float, default=0.05,
                   help="seconds before a retry (doubling)")
    f.add_argument("--breaker-failures", type=int, default=3,
                   help="failures in a row that take an instance out of rotation")
    f.add_argument("--breaker-open", type=float, default=5.0,
                   help="seconds an instance stays out before it is tried again")
    f.add_argument("--stream-idle-timeout", type=float, default=120.0,
                   help="seconds without a token before a stream is given up (then migrated)")
    f.add_argument("--max-migrations", type=int, default=3, help="times one stream may move "
                   "to another decode instance when its instance fails mid-stream (0: never)")


def _weights_help() -> str:
    """The defaults come from CostWeights itself, so the help cannot drift from them."""
    pairs = ",".join(f"{name}={value:g}" for name, value in asdict(CostWeights()).items())
    return f"{pairs} (any subset; see services/router/routing/routing_config.py)"


def _weights(text: str) -> CostWeights:
    values = {}
    for part in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in CostWeights.__dataclass_fields__:
            raise ValueError(f"--kv-cost-weights: bad entry {part!r}")
        values[name] = float(value)
    return CostWeights(**values)


def router_config(args, addresses) -> RouterConfig:
    """addresses(text) -> tuple of host:port (the comma-separated lists)."""
    routing = RoutingConfig(args.decode_policy, args.prefill_policy,
                            _weights(args.kv_cost_weights), args.session_affinity,
                            args.affinity_header)
    admission = AdmissionConfig(
        args.max_prefilling, args.max_queued, args.max_queued_tokens, args.ttft_slo,
        args.prefill_rate, args.rate_limit_rps, args.rate_limit_burst,
        args.rate_limit_tokens_per_s, args.queue_timeout, max_priority=args.max_priority)
    limits = LimitsConfig(
        max_body_bytes=args.max_body_bytes, max_stop_chars=args.max_stop_chars,
        request_timeout_s=args.request_timeout, http_max_concurrency=args.http_max_concurrency,
        http_keep_alive_s=args.http_keep_alive, http_header_timeout_s=args.http_header_timeout,
        grpc_max_message_bytes=args.grpc_max_message_bytes,
        grpc_max_concurrent_rpcs=args.grpc_max_concurrent_rpcs)
    fallback = FallbackConfig(args.prefill_retries, args.decode_retries, args.retry_backoff,
                              args.breaker_failures, args.breaker_open,
                              args.stream_idle_timeout, args.max_migrations)
    return RouterConfig(
        model=args.model, served_model_name=args.served_model_name,
        backends=addresses(args.backends), host=args.host, port=args.port,
        grpc_port=args.grpc_port, health_interval_s=args.health_interval, max_n=args.max_n,
        prefill_backends=addresses(args.prefill_backends), kv_store=args.kv_store,
        kv_block_secret_file=args.kv_block_secret_file,
        min_prefill_tokens=args.min_prefill_tokens, prefill_timeout_s=args.prefill_timeout,
        max_prefill_queue_tokens=args.max_prefill_queue_tokens, registry_url=args.registry,
        api_key_file=args.api_key_file, tenant_secret_file=args.tenant_secret_file,
        routing=routing, admission=admission, fallback=fallback, limits=limits,
        tls=tls_from_args(args, "router"), workers=args.workers,
        worker_index=args.worker_index)
