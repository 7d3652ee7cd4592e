"""`pdserve up` (the whole stack, one process per service) and `pdserve serve <service>`.

`add_subcommands(subparsers)` adds both to the top-level `pdserve` parser; each parsed
namespace carries `func`, which runs the command and returns the exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Optional

from pdserve.common.engine.cli import add_weights_arg


def add_subcommands(subparsers) -> None:
    up = subparsers.add_parser("up", help="start the whole stack (router + engines) locally")
    up.add_argument("--mode", choices=["colocated", "disagg"], default="colocated",
                    help="colocated: one unified engine (prefill and decode in one process); "
                         "disagg: redis, KV store, prefill, decode and router processes")
    up.add_argument("--model", default="smollm2", help="smollm2, tiny, a GGUF file or HF dir")
    up.add_argument("--host", default="127.0.0.1",
                    help="address every service binds")
    up.add_argument("--port", type=int, default=8000, help="router HTTP (OpenAI API)")
    up.add_argument("--grpc-port", type=int, default=50051, help="router gRPC (Generate)")
    up.add_argument("--engine-port", type=int, default=0, help="engine gRPC; 0 -> a free port")
    up.add_argument("--log-dir", default=None, help="default: a new folder under /tmp")
    up.add_argument("--startup-timeout", type=float, default=300.0,
                    help="seconds each service may take to become healthy")
    up.add_argument("--insecure", action="store_true", help="plaintext gRPC between the "
                    "services (default: mutual TLS with a fresh CA made for this run)")
    up.add_argument("--tls-dir", default="", help="use these certificates (`pdserve certs "
                    "--out DIR`) instead of a fresh CA, e.g. to give gRPC clients one")
    up.add_argument("--discovery", choices=["registry", "static"], default="registry",
                    help="registry: engines register in a redis the launcher starts and the "
                         "router watches it; static: the router gets the address lists")
    up.add_argument("--replicas", type=int, default=1, help="colocated: unified engines")
    from pdserve.services.router.config import RouterConfig

    up.add_argument("--router-workers", type=int, default=RouterConfig.workers, metavar="N",
                    help="router processes sharing its HTTP and gRPC ports (SO_REUSEPORT; "
                         "services/router/workers.py says what they share)")
    up.add_argument("--side-cpus", default="auto", metavar="CORES|auto|any",
                    help="cores for redis, the KV store and the router; auto: the cores no "
                         "decode or unified engine is pinned to, when there are such cores "
                         "(so they never take a decode core's time), else unpinned; any: "
                         "never pinned")
    up.add_argument("--router-arg", action="append", default=[], metavar="WORD",
                    help="one more word for the router's command line (repeatable), e.g. "
                         "--router-arg=--decode-policy --router-arg=round_robin")
    _engine_args(up)
    _disagg_up_args(up)
    up.set_defaults(func=_run_up)

    serve = subparsers.add_parser("serve", help="run one service in the foreground")
    which = serve.add_subparsers(dest="service", required=True)
    router = which.add_parser("router", help="OpenAI-compatible HTTP + gRPC router")
    router.add_argument("--model", default="smollm2", help="where the tokenizer comes from")
    router.add_argument("--served-model-name", default="",
                        help="model name clients send and /v1/models lists (empty: --model)")
    router.add_argument("--backends", default="127.0.0.1:50061",
                        help="comma-separated host:port (or dns:NAME:PORT) of unified engine "
                             "instances; may be empty with --registry")
    router.add_argument("--host", default="127.0.0.1",
                        help="address the HTTP and gRPC APIs bind")
    router.add_argument("--port", type=int, default=8000,
                        help="OpenAI-compatible HTTP API port")
    router.add_argument("--grpc-port", type=int, default=50051, help="-1 -> no gRPC API")
    router.add_argument("--health-interval", type=float, default=1.0,
                        help="seconds between health/load polls of each instance")
    router.add_argument("--max-n", type=int, default=8,
                        help="largest `n` (choices per request) accepted; more: 400")
    router.add_argument("--prefill-backends", default="",
                        help="comma-separated host:port of prefill instances: disaggregated "
                             "mode (--backends are then decode instances; needs --kv-store)")
    router.add_argument("--kv-store", default="", help="KV store master host:port")
    router.add_argument("--min-prefill-tokens", type=int, default=0,
                        help="fewer uncached prompt tokens than this: skip prefill, decode "
                             "computes them")
    router.add_argument("--prefill-timeout", type=float, default=60.0,
                        help="seconds before a Prefill is given up and retried elsewhere")
    router.add_argument("--workers", type=int, default=RouterConfig.workers, metavar="N",
                        help="N > 1: this process starts N router processes that share the "
                             "HTTP and gRPC ports (SO_REUSEPORT), each with 1/N of the "
                             "admission and connection limits, metrics summed over them "
                             "(services/router/workers.py)")
    router.add_argument("--worker-index", type=int, default=RouterConfig.worker_index,
                        help="set by the --workers supervisor on each worker it starts: this "
                             "process is that worker (-1: not a worker)")
    from pdserve.services.router.cli_args import add_router_args

    add_router_args(router)  # routing, admission, fallback ladder, registry, API keys
    router.set_defaults(func=_run_router)
    from pdserve.services.kvstore.cli import add_kvstore_subcommands

    add_kvstore_subcommands(which)  # kvstore, kvstore-master, kvstore-node
    for name, port, roles in (("decode", 50061, ["unified", "decode"]),
                              ("prefill", 50071, ["prefill"])):
        p = which.add_parser(name, help=f"{name} engine instance (gRPC)")
        p.add_argument("--role", choices=roles, default=roles[0],
                       help="unified: whole requests; decode: continues from prefill's KV; "
                            "prefill: prompts only")
        p.add_argument("--host", default="127.0.0.1",
                       help="address the engine's gRPC server binds")
        p.add_argument("--port", type=int, default=port,
                       help="engine gRPC port")
        p.add_argument("--model", default="smollm2",
                       help="smollm2, tiny, a GGUF file or a Hugging Face folder")
        _engine_args(p)
        _kv_args(p)
        _registry_args(p)
        from pdserve.services.common.tls_args import add_tls_args

        add_tls_args(p)  # the engine's gRPC port (a unified engine uses the decode cert)
        p.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM: seconds running requests may take to finish")
        p.add_argument("--metrics-port", type=int, default=0,
                       help="serve Prometheus /metrics over HTTP on this port; 0 -> none")
        p.add_argument("--otlp-endpoint", default="",
                       help="export traces over OTLP/gRPC here (default: "
                            "$OTEL_EXPORTER_OTLP_ENDPOINT; neither -> no export)")
        p.set_defaults(func=_run_engine)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny-seed", type=int, default=0,
                   help="weights seed of --model tiny (engines and router must agree)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--cpus", default="", help="pin the engine to cores, e.g. 0,1")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="longest prompt + completion in tokens")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="sequences in one engine batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens one engine step computes at most (chunked prefill)")
    p.add_argument("--itl-target-ms", type=float, default=0.0,
                   help="adapt the per-step token budget (up to --max-num-batched-tokens) so "
                        "steps carrying decodes take about this long; 0 -> fixed budget")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV cache block (the store and the router's cache keys use it)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV cache blocks (default: from --kv-cache-bytes or the free memory)")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="KV cache size in bytes (default: a share of the free memory)")
    p.add_argument("--memory-budget-bytes", type=int, default=None,
                   help="weights + activation peak + KV cache of one engine; the KV gets what "
                        "is left (`up` default: each engine's share of the host's memory)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="no automatic prefix caching (as vllm's --no-enable-prefix-caching)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="auto: triton on CUDA, torch on the CPU")
    p.add_argument("--cpu-gemm", choices=["auto", "onednn", "torch"], default="auto",
                   help="CPU linears: oneDNN prepacked (auto when available) or torch's matmul")
    from pdserve.common.engine.cli import add_host_heap_arg, add_parallel_args
    add_host_heap_arg(p)
    add_parallel_args(p)
    add_weights_arg(p)


def _disagg_up_args(up: argparse.ArgumentParser) -> None:
    g = up.add_argument_group("disagg mode")
    g.add_argument("--prefill", type=int, default=1, help="prefill instances")
    g.add_argument("--decode", type=int, default=1, help="decode instances")
    g.add_argument("--prefill-cpus", default="", help="pin prefill to these cores, e.g. 0")
    g.add_argument("--decode-cpus", default="", help="pin decode to these cores, e.g. 1")
    g.add_argument("--prefill-threads", type=int, default=1, help="torch threads of prefill")
    g.add_argument("--decode-threads", type=int, default=1, help="torch threads of decode")
    g.add_argument("--kv-store-port", type=int, default=0, help="store master; 0 -> free")
    g.add_argument("--redis-port", type=int, default=0, help="0 -> a free port")
    g.add_argument("--kv-capacity-mib", type=int, default=1024, help="storage node segment")
    g.add_argument("--kv-transport", choices=["auto", "ucx", "tcp"], default="auto",
                   help="how engines reach the KV store's nodes (auto: UCX where available)")
    g.add_argument("--kv-reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="KV reuse on the engines (docs/kv-reuse.md)")
    g.add_argument("--kv-per-rank", action=argparse.BooleanOptionalAction, default=None,
                   help="every engine's tensor-parallel ranks move their own KV heads "
                        "(serve's --kv-per-rank; default: the engines' own)")
    g.add_argument("--min-prefill-tokens", type=int, default=0,
                   help="fewer uncached prompt tokens: decode computes them, no prefill")


def _kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-store", default="",
                   help="KV store master host:port; prefill saves its blocks there, decode "
                        "loads them, unified does both (a shared prefix cache). "
                        "Empty: no store")
    p.add_argument("--kv-transport", choices=["auto", "ucx", "tcp"], default="auto",
                   help="how to reach the store's nodes")
    p.add_argument("--kv-lease", type=float, default=30.0,
                   help="seconds a saved block is safe from eviction")
    p.add_argument("--kv-load-timeout", type=float, default=10.0,
                   help="a KV load slower than this is given up and recomputed")
    p.add_argument("--kv-reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="KV reuse (docs/kv-reuse.md): prefill also loads the stored prefix, "
                        "decode also saves what its finished requests computed")
    p.add_argument("--kv-layer-segments", type=int, default=1,  # (torch-free: no config import)
                   help="store each KV block as this many objects, each a run of layers, so "
                        "prefill puts the first layers while the later ones compute; every "
                        "engine sharing the store must use the same value (docs/kv-reuse.md)")
    p.add_argument("--kv-per-rank", action=argparse.BooleanOptionalAction, default=None,
                   help="every tensor-parallel rank moves its own KV heads through the store, "
                        "one object per head (default: EngineServiceConfig.kv_per_rank); "
                        "every engine sharing the store must use the same mode "
                        "(docs/parallelism.md)")
    p.add_argument("--kv-block-secret-file", default="",
                   help="file with the block secret every engine and the router share: "
                        "keys and MACs of stored blocks (default: "
                        "$PDSERVE_KV_BLOCK_SECRET_FILE; none: unauthenticated blocks)")


def _registry_args(p: argparse.ArgumentParser) -> None:
    from pdserve.services.registry.config import Registration as R

    g = p.add_argument_group("instance registry")
    g.add_argument("--registry", default=R.url, metavar="URL",
                   help="redis://[:PASSWORD@]HOST:PORT/DB: heartbeat this instance's address, "
                        "role, model and load there (routers watching it use it); with a "
                        "password give @FILE. Empty: no registry")
    g.add_argument("--advertise-address", default=R.advertise_address, metavar="HOST:PORT",
                   help="the address routers dial, e.g. the pod IP (empty: --host:--port, "
                        "a wildcard host replaced by this host's address)")
    g.add_argument("--registry-interval", type=float, default=R.interval_s,
                   help="seconds between heartbeats")
    g.add_argument("--registry-ttl", type=float, default=R.ttl_s,
                   help="seconds an entry outlives its last heartbeat (a crashed instance "
                        "drops out after this)")


def engine_argv(args, cpus: Optional[str] = None, threads: Optional[int] = None) -> list[str]:
    """The engine options of `args` as command-line words (the launcher passes them on);
    `cpus` / `threads` replace args.cpus / args.num_threads (one instance of several)."""
    cpus = args.cpus if cpus is None else cpus
    threads = args.num_threads if threads is None else threads
    argv = ["--tiny-seed", str(args.tiny_seed), "--num-threads", str(threads),
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--itl-target-ms", str(args.itl_target_ms),
            "--block-size", str(args.block_size), "--device", args.device,
            "--attention-backend", args.attention_backend, "--cpu-gemm", args.cpu_gemm,
            "--host-heap", args.host_heap, "--weights", args.weights,
            "--kv-cache-dtype", args.kv_cache_dtype,
            "--dtype", args.dtype]
    from pdserve.common.engine.cli import parallel_argv
    argv += parallel_argv(args)
    if cpus:
        argv += ["--cpus", cpus]
    if args.num_blocks is not None:
        argv += ["--num-blocks", str(args.num_blocks)]
    if args.kv_cache_bytes is not None:
        argv += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if args.memory_budget_bytes is not None:
        argv += ["--memory-budget-bytes", str(args.memory_budget_bytes)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    from pdserve.services.ports import free_port  # every engine serves its vllm: series

    argv += ["--metrics-port", str(free_port(args.host))]
    return argv


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _run_engine(args) -> int:
    from pdserve.services.engine_host.engine_server import run_engine_server

    _setup_logging()
    asyncio.run(run_engine_server(engine_service_config(args)))
    return 0


def engine_service_config(args):
    """The EngineServiceConfig of `pdserve serve decode|prefill` flags (bench offline's engine
    is checked against it: tests/unit/test_bench_offline_engine.py)."""
    from pdserve.common.engine.cli import parallel_config
    from pdserve.services.common.tls_args import tls_from_args
    from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
    from pdserve.services.registry.config import Registration

    return EngineServiceConfig(
        role=args.role, host=args.host, port=args.port, model=args.model,
        tiny_seed=args.tiny_seed, num_threads=args.num_threads,
        cpus=tuple(int(c) for c in args.cpus.split(",") if c),
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        itl_target_ms=args.itl_target_ms,
        num_blocks=args.num_blocks, kv_cache_bytes=args.kv_cache_bytes,
        memory_budget_bytes=args.memory_budget_bytes,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_store=args.kv_store, kv_transport=args.kv_transport, kv_lease_s=args.kv_lease,
        kv_load_timeout_s=args.kv_load_timeout, kv_reuse=args.kv_reuse,
        kv_layer_segments=args.kv_layer_segments,
        # None: the config's default (its one source)
        **({} if args.kv_per_rank is None else {"kv_per_rank": args.kv_per_rank}),
        kv_block_secret_file=args.kv_block_secret_file,
        metrics_port=args.metrics_port,
        otlp_endpoint=args.otlp_endpoint, device=args.device,
        drain_timeout_s=args.drain_timeout,
        registration=Registration(args.registry, args.advertise_address,
                                  args.registry_interval, args.registry_ttl),
        attention_backend=args.attention_backend, cpu_gemm=args.cpu_gemm,
        host_heap=args.host_heap, weights=args.weights,
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, parallel=parallel_config(args),
        tls=tls_from_args(args, "prefill" if args.role == "prefill" else "decode"))


def _run_router(args) -> int:
    from pdserve.services.router.cli_args import router_config
    from pdserve.services.router.server import run_router

    _setup_logging()
    cfg = router_config(args, _addresses)
    if cfg.workers > 1 and cfg.worker_index < 0:  # supervises the workers, serves nothing
        from pdserve.services.router.workers import run_supervisor

        return run_supervisor(cfg, args.argv)
    import torch  # the tokenizer loader imports it; keep it off the other services' cores

    torch.set_num_threads(1)
    asyncio.run(run_router(cfg))
    return 0


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def _run_up(args) -> int:
    from pdserve.services.launcher import run_up

    for name, value in (("replicas", args.replicas), ("prefill", args.prefill),
                        ("decode", args.decode)):
        if not 1 <= value <= 64:
            raise ValueError(f"--{name} must be in [1, 64], got {value}")
    return run_up(args)


def run_parser(parser: argparse.ArgumentParser, argv=None) -> int:
    """Parse argv and run the chosen command; a config that refuses its settings (ValueError)
    becomes a usage error."""
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the words, for re-exec
    try:
        return args.func(args)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv=None) -> int:
    """Entry point for these subcommands alone (`python -m pdserve.services.cli_serve`), which
    the launcher uses: it does not import the bench."""
    from pdserve.services.common.arg_files import cli_parser

    parser = cli_parser()  # `--flag @FILE`: the value comes from FILE (secrets)
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return run_parser(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
