"""What `pdserve up` starts, per mode, in start order, with each service's readiness check and
the map of what runs where.

Discovery (`--discovery`): `registry` (the default) starts redis-server first; every engine
heartbeats its address, role, model, fingerprint, block size, load and prefix-cache summary
into it and the router watches it, so a restarted or added instance is found without the
router being told. `static` passes the engines' addresses on the router's command line.
colocated: `--replicas N` unified engines, then the router.
disagg: the KV store (master and one storage node, one process; its metadata in the same
redis), `--prefill N` prefill and `--decode M` decode instances, then the router.
Secrets: with `tls_dir` (from `pdserve certs`, or the fresh CA `up` makes) every engine, the
router and the KV store master speak mutual TLS; Redis gets a password kept in `secret_dir` (a
private folder), which reaches the services as `--flag @FILE` (services/common/arg_files.py),
never as argv; disagg also makes the KV store's two secrets there (store-secret for the
master and node, block-secret for the engines and router: services/common/kv_secrets.py).
Memory: engines on this host split one share of its free memory (engine_memory_share), each
planning its KV cache from its budget after a profiling forward (common/engine/startup.py);
the map prints each engine's budget, and each engine's KV blocks once it is ready.
Cores: explicit `--cpus` / `--prefill-cpus` / `--decode-cpus` pin every instance of that kind
there; otherwise, when the machine has at least one core per engine, each engine gets its own
core (prefill instances first), and with fewer cores none is pinned (the map says so).
Redis, the KV store and the router go to `--side-cpus`; by default (auto) to the cores no
decode or unified engine is pinned to, so their wake-ups never take a decode step's core (on 2
cores with prefill on 0 and decode on 1 that moved the decode step's ITL from 1.24x to 1.13x
the offline step), and unpinned when the engines hold every core.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pdserve.services.common.kv_secrets import KVSecretFiles, make_kv_secrets
from pdserve.services.common.tls_args import tls_argv
from pdserve.services.launcher import (Child, Step, engine_kv_budget, engine_serving, free_port,
                                       http_ok)

ROOT = Path(__file__).resolve().parents[1]
SERVE = [sys.executable, "-m", "pdserve.services.cli_serve", "serve"]
REGISTRY_DB = 1  # the KV store's metadata lives in db 0 of the same redis


@dataclass(frozen=True)
class Plan:
    steps: list[Step]
    layout: str  # the map of what runs where, printed before anything starts
    endpoints: str  # the banner printed once everything is ready


@dataclass(frozen=True)
class _Engine:
    name: str  # prefill0, decode1, unified0
    role: str  # prefill | decode | unified
    cpus: str
    threads: int


def plan_stack(args, log_dir: Path, tls_dir: str = "", secret_dir: str = "") -> Plan:
    """`tls_dir`: the certificates every gRPC server and client of the stack uses ("" for
    plaintext); `secret_dir`: a private folder for Redis's password (needed whenever the stack
    starts Redis: registry discovery or disagg)."""
    engines = _engines(args)
    side = side_cpus(args.side_cpus, engines)
    rows: list[tuple[str, str, str, str]] = []  # (name, address, cores, what)
    steps: list[Step] = []
    registry = ""
    redis_urls: dict[int, str] = {}
    if args.discovery == "registry" or args.mode == "disagg":
        if not secret_dir:
            raise ValueError("a stack with Redis needs a private secret_dir for its password")
        redis_port = args.redis_port or free_port(args.host)
        step, redis_urls = _redis(args, log_dir, redis_port, Path(secret_dir) / "redis")
        steps.append(_pinned(step, side))
        registry = f"@{redis_urls[REGISTRY_DB]}"  # the URL file: the password stays off argv
        rows.append(("redis", f"{args.host}:{redis_port}", side or "any",
                     "instance registry" + (" + KV store metadata" if args.mode == "disagg"
                                            else "")))
    if args.discovery != "registry":
        registry = ""
    store, kv_secrets = "", None
    if args.mode == "disagg":
        store = f"{args.host}:{args.kv_store_port or free_port(args.host)}"
        kv_secrets = make_kv_secrets(Path(secret_dir) / "kv")
        steps.append(_pinned(_kvstore(args, log_dir, store, redis_urls[0], tls_dir,
                                      kv_secrets.store), side))
        rows.append(("kvstore", store, side or "any",
                     f"KV store master + node, {args.kv_capacity_mib} MiB"))
    addrs: dict[str, list[str]] = {"prefill": [], "decode": []}
    budget = engine_memory_share(args, len(engines))
    for e in engines:
        step, addr = _engine(args, log_dir, e, store, registry, tls_dir, kv_secrets, budget)
        steps.append(step)
        addrs["prefill" if e.role == "prefill" else "decode"].append(addr)
        rows.append((e.name, addr, e.cpus or "any", f"{e.role}, {e.threads} torch thread(s), "
                     f"{_budget_words(args, budget)}"))
    steps.append(_pinned(_router(args, log_dir, addrs, store, registry, tls_dir, kv_secrets),
                         side))
    rows.append(("router", f"{args.host}:{args.port}", side or "any",
                 f"HTTP; gRPC :{args.grpc_port}; discovery {args.discovery}"
                 + (f"; {args.router_workers} workers" if args.router_workers != 1 else "")))
    return Plan(steps, _layout(rows, engines), _banner(args, addrs, store, tls_dir))


def engine_memory_share(args, num_engines: int) -> Optional[int]:
    """Each engine's memory budget (weights + activation peak + KV) when the user sized none:
    the engines on this host split one share of its free memory (CacheConfig's
    kv_cache_fraction of it) instead of each taking that fraction of all of it. None: sized
    by the user (blocks, KV bytes or a budget), or engines on GPUs (their own memory)."""
    from pdserve.common.config import CacheConfig
    from pdserve.common.kv.memory import available_memory_bytes

    if args.num_blocks is not None or args.kv_cache_bytes is not None \
            or args.memory_budget_bytes is not None or args.device != "cpu":
        return None
    return int(available_memory_bytes("cpu") * CacheConfig.kv_cache_fraction) // num_engines


def _budget_words(args, budget: Optional[int]) -> str:
    if budget is not None:
        return f"memory budget {budget / 2**20:.0f} MiB (its share of the host)"
    if args.memory_budget_bytes is not None:
        return f"memory budget {args.memory_budget_bytes / 2**20:.0f} MiB"
    return "KV sized by --num-blocks / --kv-cache-bytes" if args.device == "cpu" \
        else f"KV from free {args.device} memory"


def _engines(args) -> list[_Engine]:
    """The engines of the mode with their cores (see the module docstring)."""
    if args.mode == "disagg":
        kinds = [("prefill", i, args.prefill_cpus, args.prefill_threads)
                 for i in range(args.prefill)]
        kinds += [("decode", i, args.decode_cpus, args.decode_threads)
                  for i in range(args.decode)]
    else:
        kinds = [("unified", i, args.cpus, args.num_threads) for i in range(args.replicas)]
    explicit = any(c for _, _, c, _ in kinds)
    cores = sorted(os.sched_getaffinity(0))
    auto = not explicit and len(kinds) > 1 and len(cores) >= len(kinds)
    return [_Engine(f"{role}{i}", role, str(cores[k]) if auto else cpus, threads)
            for k, (role, i, cpus, threads) in enumerate(kinds)]


def side_cpus(flag: str, engines: list[_Engine]) -> str:
    """The cores of the stack's other processes (redis, KV store, router) from `--side-cpus`:
    a core list as given, "any" -> "" (unpinned), "auto" -> the cores left when the decode and
    unified engines' pinned cores are taken out ("" when none is pinned or none is left)."""
    if flag == "any":
        return ""
    if flag != "auto":
        _cores(flag)  # a bad list is a ValueError here, not a taskset failure at start
        return flag
    taken = set()
    for e in engines:
        if e.role != "prefill" and e.cpus:
            taken |= _cores(e.cpus)
    left = sorted(set(os.sched_getaffinity(0)) - taken)
    return ",".join(map(str, left)) if taken and left else ""


def _cores(cpus: str) -> set[int]:
    """"0,2-3" -> {0, 2, 3}; ValueError on anything else."""
    out: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"not a core list: {cpus!r} (e.g. 0,2-3)")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def _pinned(step: Step, cpus: str) -> Step:
    """The step's process pinned to `cpus` from exec on (its threads and children too)."""
    step.child.argv = _taskset(step.child.argv, cpus)
    return step


def _taskset(words: list[str], cpus: str) -> list[str]:
    """`words` run under `taskset -c cpus` (pinned from exec on, before any thread starts);
    unchanged when `cpus` is empty or taskset is missing."""
    return ["taskset", "-c", cpus] + words if cpus and shutil.which("taskset") else words


def _redis(args, log_dir: Path, port: int, auth: Path) -> tuple[Step, dict[int, str]]:
    """redis-server with a password (redis.conf in `auth`), and the URL file of each database
    the stack uses: db 0 the KV store's metadata, REGISTRY_DB the instance registry."""
    from urllib.parse import urlsplit

    from pdserve.services.common.redis_auth import CONF_FILE, URL_FILE, make_redis_auth

    redis_dir = log_dir / "redis"
    redis_dir.mkdir(exist_ok=True)
    url = make_redis_auth(auth, f"redis://{args.host}:{port}/0")
    password = urlsplit(url).password
    registry_file = auth / "registry-url"
    fd = os.open(registry_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url.rsplit("/", 1)[0] + f"/{REGISTRY_DB}")
    child = Child("redis", [redis_server(), str(auth / CONF_FILE), "--bind", args.host,
                            "--port", str(port), "--dir", str(redis_dir), "--save", "",
                            "--appendonly", "no"], log_dir)
    urls = {0: str(auth / URL_FILE), REGISTRY_DB: str(registry_file)}
    return Step(child, lambda: redis_ready(args.host, port, password)), urls


def _kvstore(args, log_dir: Path, store: str, redis_url_file: str, tls_dir: str,
             store_secret: str) -> Step:
    child = Child("kvstore", SERVE + [
        "kvstore", "--host", args.host, "--port", store.rsplit(":", 1)[1],
        "--redis-url", f"@{redis_url_file}",  # read from the file: not in argv
        "--store-secret-file", store_secret,
        "--capacity-mib", str(args.kv_capacity_mib), "--transport", args.kv_transport,
        *tls_argv(tls_dir)], log_dir)
    return Step(child, lambda: store_ready(store, tls_dir))


def _engine(args, log_dir: Path, e: _Engine, store: str, registry: str,
            tls_dir: str, kv_secrets: Optional[KVSecretFiles],
            memory_budget: Optional[int] = None) -> tuple[Step, str]:
    from pdserve.services.cli_serve import engine_argv

    single = args.mode == "colocated" and args.replicas == 1
    port = args.engine_port if single and args.engine_port else free_port(args.host)
    addr = f"{args.host}:{port}"
    service = "prefill" if e.role == "prefill" else "decode"
    role = [] if e.role == "prefill" else ["--role", e.role]
    words = SERVE + [service, *role, "--host", args.host, "--port", str(port),
                     "--model", args.model, *engine_argv(args, cpus=e.cpus, threads=e.threads),
                     *tls_argv(tls_dir)]
    if memory_budget is not None:
        words += ["--memory-budget-bytes", str(memory_budget)]
    if store:
        words += ["--kv-store", store, "--kv-transport", args.kv_transport,
                  "--kv-block-secret-file", kv_secrets.block]
        if not args.kv_reuse:
            words.append("--no-kv-reuse")
        if args.kv_per_rank is not None:  # one mode for every engine sharing the store
            words.append("--kv-per-rank" if args.kv_per_rank else "--no-kv-per-rank")
    if registry:
        words += ["--registry", registry]
    child = Child(e.name, _taskset(words, e.cpus), log_dir)
    return Step(child, lambda: engine_serving(addr, service, tls_dir),
                lambda: engine_kv_budget(addr, service, tls_dir)), addr


def _router(args, log_dir: Path, addrs: dict, store: str, registry: str,
            tls_dir: str, kv_secrets: Optional[KVSecretFiles]) -> Step:
    words = SERVE + ["router", "--model", args.model, "--host", args.host,
                     "--port", str(args.port), "--grpc-port", str(args.grpc_port)]
    if registry:
        words += ["--registry", registry, "--backends", ""]
    else:
        words += ["--backends", ",".join(addrs["decode"])]
        if addrs["prefill"]:
            words += ["--prefill-backends", ",".join(addrs["prefill"])]
    if store:
        words += ["--kv-store", store, "--min-prefill-tokens", str(args.min_prefill_tokens),
                  "--kv-block-secret-file", kv_secrets.block]
    if args.router_workers != 1:
        words += ["--workers", str(args.router_workers)]
    words += tls_argv(tls_dir) + list(args.router_arg or ())
    child = Child("router", words, log_dir)
    return Step(child, lambda: http_ok(f"http://{args.host}:{args.port}/health"))


def _layout(rows, engines: list[_Engine]) -> str:
    lines = ["  what runs where:"]
    lines += [f"    {n:<10} {a:<22} cores {c:<5} {w}" for n, a, c, w in rows]
    if len(engines) > 1 and not any(e.cpus for e in engines):
        lines.append(f"    ({len(engines)} engines on {len(os.sched_getaffinity(0))} cores: "
                     f"not pinned, they share the cores)")
    return "\n".join(lines)


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


def store_ready(master_addr: str, tls_dir: str = "") -> bool:
    """The master answers and knows at least one storage node (asked with the router's
    certificate when `tls_dir` is set: Stats is for the store's callers)."""
    import grpc

    from pdserve.common.rpc import kvstore_pb2 as pb
    from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
    from pdserve.services.common.tls import TlsConfig, open_channel

    tls = TlsConfig.from_dir(tls_dir, "router") if tls_dir else TlsConfig()
    with open_channel(master_addr, tls, "kvstore-master", aio=False) as ch:
        try:
            return len(pb_grpc.KVStoreMasterStub(ch).Stats(pb.StatsRequest(),
                                                           timeout=1).nodes) > 0
        except grpc.RpcError:
            return False


def _banner(args, addrs: dict, store: Optional[str], tls_dir: str) -> str:
    base = f"http://{args.host}:{args.port}"
    lines = [f"  OpenAI API    {base}/v1  (completions, chat/completions, models)",
             f"  health        {base}/health",
             f"  metrics       {base}/metrics",
             f"  router gRPC   {args.host}:{args.grpc_port}  (pdserve.v1.Router/Generate)"]
    for kind in ("prefill", "decode"):
        label = "unified" if args.mode == "colocated" else kind
        for a in addrs[kind]:
            lines.append(f"  {label:<13} {a}")
    if store:
        lines.append(f"  KV store      {store}  (master)")
    lines.append(f"  mutual TLS    gRPC needs a certificate: {tls_dir}/client.pem, client-key.pem, "
                 f"ca.pem" if tls_dir else "  mutual TLS    off (--insecure)")
    return "\n".join(lines)
