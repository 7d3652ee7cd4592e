"""What `pdserve up` starts, per mode, in start order, with each service's readiness check.

colocated: one unified engine, then the router.
disagg: redis-server (the KV store's metadata; installed with scripts/ensure_redis.sh when
missing), the KV store (master and one storage node, one process), a prefill instance, a
decode instance, then the router in disaggregated mode. Prefill and decode each get their own
cores (`--prefill-cpus`, `--decode-cpus`, pinned with taskset) and torch thread counts.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from pdserve.services.common.tls_args import tls_argv
from pdserve.services.launcher import Child, Step, engine_serving, free_port, http_ok

ROOT = Path(__file__).resolve().parents[1]
SERVE = [sys.executable, "-m", "pdserve.services.cli_serve", "serve"]


def plan_stack(args, log_dir: Path, tls_dir: str = "",
               secret_dir: str = "") -> tuple[list[Step], str]:
    """(the services in start order, the endpoints banner); `tls_dir` (from `pdserve certs`):
    the engines and the router speak mutual TLS with those certificates; `secret_dir`: a
    private folder for Redis's password (disagg), which no command line names."""
    if args.mode == "disagg":
        if not secret_dir:
            raise ValueError("disagg mode needs a private secret_dir for Redis's password")
        return _disagg(args, log_dir, tls_dir, secret_dir)
    return _colocated(args, log_dir, tls_dir)


def _engine(args, log_dir: Path, name: str, argv: list[str], cpus: str, threads: int,
            tls_dir: str, service: str = "decode") -> tuple[Step, str]:
    from pdserve.services.cli_serve import engine_argv

    port = args.engine_port if name == "engine-unified" and args.engine_port else \
        free_port(args.host)
    addr = f"{args.host}:{port}"
    words = SERVE + argv + ["--host", args.host, "--port", str(port), "--model", args.model]
    words += engine_argv(args, cpus=cpus, threads=threads) + tls_argv(tls_dir)
    if cpus and shutil.which("taskset"):  # pinned from exec on, before any thread starts
        words = ["taskset", "-c", cpus] + words
    child = Child(name, words, log_dir)
    return Step(child, lambda: engine_serving(addr, service, tls_dir)), addr


def _router(args, log_dir: Path, backends: str, extra: list[str], tls_dir: str) -> Step:
    child = Child("router", SERVE + [
        "router", "--model", args.model, "--backends", backends, "--host", args.host,
        "--port", str(args.port), "--grpc-port", str(args.grpc_port)] + extra
        + tls_argv(tls_dir), log_dir)
    return Step(child, lambda: http_ok(f"http://{args.host}:{args.port}/health"))


def _colocated(args, log_dir: Path, tls_dir: str) -> tuple[list[Step], str]:
    engine, addr = _engine(args, log_dir, "engine-unified", ["decode", "--role", "unified"],
                           args.cpus, args.num_threads, tls_dir)
    return [engine, _router(args, log_dir, addr, [], tls_dir)], \
        _banner(args, f"{addr}  (unified)", tls_dir)


def _disagg(args, log_dir: Path, tls_dir: str, secret_dir: str) -> tuple[list[Step], str]:
    from urllib.parse import urlsplit

    from pdserve.services.common.redis_auth import CONF_FILE, URL_FILE, make_redis_auth

    redis_port = args.redis_port or free_port(args.host)
    store_port = args.kv_store_port or free_port(args.host)
    store = f"{args.host}:{store_port}"
    redis_dir = log_dir / "redis"
    redis_dir.mkdir(exist_ok=True)
    auth = Path(secret_dir) / "redis"  # redis.conf (requirepass) and the store's URL file
    password = urlsplit(make_redis_auth(auth, f"redis://{args.host}:{redis_port}/0")).password
    redis = Child("redis", [redis_server(), str(auth / CONF_FILE), "--bind", args.host,
                            "--port", str(redis_port), "--dir", str(redis_dir), "--save", "",
                            "--appendonly", "no"], log_dir)
    kv = Child("kvstore", SERVE + [
        "kvstore", "--host", args.host, "--port", str(store_port),
        "--redis-url", f"@{auth / URL_FILE}",  # read from the file: not in argv
        "--capacity-mib", str(args.kv_capacity_mib), "--transport", args.kv_transport], log_dir)
    kv_words = ["--kv-store", store, "--kv-transport", args.kv_transport]
    prefill, paddr = _engine(args, log_dir, "prefill", ["prefill"] + kv_words,
                             args.prefill_cpus, args.prefill_threads, tls_dir, service="prefill")
    decode, daddr = _engine(args, log_dir, "decode", ["decode", "--role", "decode"] + kv_words,
                            args.decode_cpus, args.decode_threads, tls_dir)
    router = _router(args, log_dir, daddr, [
        "--prefill-backends", paddr, "--kv-store", store,
        "--min-prefill-tokens", str(args.min_prefill_tokens)], tls_dir)
    steps = [Step(redis, lambda: redis_ready(args.host, redis_port, password)),
             Step(kv, lambda: store_ready(store)), prefill, decode, router]
    return steps, _banner(args, f"{paddr}  (prefill)\n  decode gRPC   {daddr}  (decode)\n"
                                f"  KV store      {store}  (master; redis :{redis_port})",
                          tls_dir)


def redis_server() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        subprocess.run(["bash", str(ROOT / "scripts" / "ensure_redis.sh")], check=False)
        exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is missing and scripts/ensure_redis.sh could not "
                           "install it; install Debian's redis-server package")
    return exe


def redis_ready(host: str, port: int, password: str = "") -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            if password:
                s.sendall(b"AUTH %s\r\n" % password.encode())
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def store_ready(master_addr: str) -> bool:
    """The master answers and knows at least one storage node."""
    import grpc

    from pdserve.common.rpc import kvstore_pb2 as pb
    from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc

    with grpc.insecure_channel(master_addr) as ch:
        try:
            return len(pb_grpc.KVStoreMasterStub(ch).Stats(pb.StatsRequest(),
                                                           timeout=1).nodes) > 0
        except grpc.RpcError:
            return False


def _banner(args, engines: str, tls_dir: str) -> str:
    base = f"http://{args.host}:{args.port}"
    tls = (f"  mutual TLS    gRPC needs a certificate: {tls_dir}/client.pem, client-key.pem, "
           f"ca.pem" if tls_dir else "  mutual TLS    off (--insecure)")
    return (f"  OpenAI API    {base}/v1  (completions, chat/completions, models)\n"
            f"  health        {base}/health\n"
            f"  metrics       {base}/metrics\n"
            f"  router gRPC   {args.host}:{args.grpc_port}  (pdserve.v1.Router/Generate)\n"
            f"  engine gRPC   {engines}\n{tls}")
