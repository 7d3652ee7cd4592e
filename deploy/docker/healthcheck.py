#!/usr/bin/env python3
"""`pdserve-healthcheck`: is a pdserve service healthy? Exit 0 if so, 1 if not (Docker's and
Kubernetes' exec-probe convention). The image installs this file as
/usr/local/bin/pdserve-healthcheck.

    pdserve-healthcheck                       the `pdserve serve ...` process in this container
    pdserve-healthcheck --pid N               the same, for process N's command line
    pdserve-healthcheck http URL              GET URL answers 200 (the router's /health)
    pdserve-healthcheck engine HOST:PORT [--role unified|decode|prefill] [--tls-dir DIR]
                                              the engine's gRPC Health says SERVING (over
                                              mutual TLS with DIR's client certificate)
    pdserve-healthcheck kvstore-master HOST:PORT [--tls-dir DIR]
                                              the KV store master answers Stats
    pdserve-healthcheck kvstore-node MASTER NODE_ID [--tls-dir DIR]
                                              the master lists NODE_ID among its live nodes

Without a mode it reads the service's own command line (/proc/PID/cmdline) with pdserve's own
`serve` parser, so the check always names the host, port and role the service really listens
on; that is what the image's HEALTHCHECK and the Helm chart's exec probes use (Kubernetes does
not expand $(VAR) in probes, but the process's command line already holds the expanded values).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0
WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


def check_http(url: str) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            return resp.status == 200, f"{url} -> {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url} -> {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{url} -> {exc}"


def _channel(address: str, tls, server_role: str):
    """Plaintext, or mutual TLS with the service's own certificate (`tls`, a TlsConfig)."""
    from pdserve.services.common.tls import TlsConfig, open_channel

    return open_channel(address, tls or TlsConfig(), server_role, aio=False)


def _tls_of(args, role: str):
    """The TLS settings a parsed `serve` command line names (services without the flags:
    plaintext)."""
    from pdserve.services.common.tls import TlsConfig
    from pdserve.services.common.tls_args import tls_from_args

    return tls_from_args(args, role) if hasattr(args, "tls_dir") else TlsConfig()


def _client_tls(tls_dir: str, role: str = "client"):
    """The certificate to ask with: the client's for engines (Health is open to every
    certificate of the CA); the store's own role for the master (Stats is for the store's
    callers, services/common/tls_roles.py)."""
    from pdserve.services.common.tls import TlsConfig

    return TlsConfig.from_dir(tls_dir, role) if tls_dir else TlsConfig()


def check_engine(address: str, role: str = "unified", tls=None) -> tuple[bool, str]:
    import grpc

    from pdserve.common.rpc import engine_pb2 as pb
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc

    stub_type = pb_grpc.PrefillServiceStub if role == "prefill" else pb_grpc.DecodeServiceStub
    with _channel(address, tls, "prefill" if role == "prefill" else "decode") as channel:
        try:
            health = stub_type(channel).Health(pb.HealthRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return False, f"engine {address}: {exc.code().name}"
    ok = health.status == pb.HealthResponse.SERVING
    return ok, f"engine {address} ({health.role}): {pb.HealthResponse.Status.Name(health.status)}"


def _master_stats(address: str, tls=None):
    from pdserve.common.rpc import kvstore_pb2 as pb
    from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc

    with _channel(address, tls, "kvstore-master") as channel:
        return pb_grpc.KVStoreMasterStub(channel).Stats(pb.StatsRequest(), timeout=TIMEOUT_S)


def check_kvstore_master(address: str, tls=None) -> tuple[bool, str]:
    import grpc

    try:
        stats = _master_stats(address, tls)
    except grpc.RpcError as exc:
        return False, f"kvstore master {address}: {exc.code().name}"
    return True, f"kvstore master {address}: {len(stats.nodes)} node(s)"


def check_kvstore_node(master: str, node_id: str, tls=None) -> tuple[bool, str]:
    """The node is healthy when the master (which drops nodes that stop heartbeating) lists it;
    an empty `node_id` accepts any node (the node's id was left to its transport address)."""
    import grpc

    try:
        stats = _master_stats(master, tls)
    except grpc.RpcError as exc:
        return False, f"kvstore master {master}: {exc.code().name}"
    ids = {n.node_id for n in stats.nodes} | {n.address for n in stats.nodes}
    ok = node_id in ids if node_id else bool(stats.nodes)
    return ok, f"kvstore node {node_id or '(any)'} {'registered' if ok else 'not registered'} " \
               f"at {master}"


def _local(host: str) -> str:
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def serve_parser() -> argparse.ArgumentParser:
    """`pdserve serve ...` exactly as the CLI parses it, without the heavy top-level imports."""
    from pdserve.services.cli_serve import add_subcommands

    from pdserve.services.common.arg_files import cli_parser

    parser = cli_parser()  # `--redis-url @FILE` as the service read it
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser


def serve_argv(cmdline: list[str]) -> list[str]:
    """The words from `serve` on in a process's argv (`pdserve serve ...`, `python -m ...`)."""
    for i, word in enumerate(cmdline):
        if word == "serve" and i + 1 < len(cmdline):
            return cmdline[i:]
    raise ValueError(f"not a `pdserve serve` command line: {cmdline!r}")


def check_for_args(args) -> tuple[bool, str]:
    """The check that fits a parsed `pdserve serve <service> ...` namespace."""
    service = args.service
    if service == "router":
        return check_http(f"http://{_local(args.host)}:{args.port}/health")
    if service in ("decode", "prefill"):
        return check_engine(f"{_local(args.host)}:{args.port}", args.role,
                            _tls_of(args, "prefill" if args.role == "prefill" else "decode"))
    if service in ("kvstore-master", "kvstore"):
        return check_kvstore_master(f"{_local(args.host)}:{args.port}",
                                    _tls_of(args, "kvstore-master"))
    if service == "kvstore-node":
        node_id = args.node_id or (f"{args.host}:{args.node_port}" if args.node_port else "")
        return check_kvstore_node(args.master, node_id, _tls_of(args, "kvstore-node"))
    return False, f"no health check for service {service!r}"


def find_serve_pid() -> int:
    """The pdserve serve process in this container: PID 1, or the first one below an init."""
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    for pid in pids:
        try:
            words = read_cmdline(pid)
        except OSError:
            continue
        if any(os.path.basename(w) == "pdserve" for w in words[:2]) and "serve" in words:
            return pid
    raise LookupError("no `pdserve serve` process found")


def read_cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [w.decode() for w in f.read().split(b"\0") if w]


def check_process(pid: int | None) -> tuple[bool, str]:
    pid = find_serve_pid() if pid is None else pid
    args = serve_parser().parse_args(serve_argv(read_cmdline(pid)))
    return check_for_args(args)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve-healthcheck", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__)
    parser.add_argument("--pid", type=int, default=None, help="auto mode: check this process")
    parser.add_argument("--quiet", action="store_true")
    modes = parser.add_subparsers(dest="mode")
    http = modes.add_parser("http")
    http.add_argument("url")
    engine = modes.add_parser("engine")
    engine.add_argument("address")
    engine.add_argument("--role", choices=["unified", "decode", "prefill"], default="unified")
    engine.add_argument("--tls-dir", default="", help="`pdserve certs` folder: ask over "
                        "mutual TLS with its client certificate")
    master = modes.add_parser("kvstore-master")
    master.add_argument("address")
    node = modes.add_parser("kvstore-node")
    node.add_argument("master")
    node.add_argument("node_id")
    for mode in (master, node):
        mode.add_argument("--tls-dir", default="", help="`pdserve certs` folder: ask over "
                          "mutual TLS with the store's own certificate")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        if args.mode == "http":
            ok, why = check_http(args.url)
        elif args.mode == "engine":
            ok, why = check_engine(args.address, args.role, _client_tls(args.tls_dir))
        elif args.mode == "kvstore-master":
            ok, why = check_kvstore_master(args.address,
                                           _client_tls(args.tls_dir, "kvstore-master"))
        elif args.mode == "kvstore-node":
            ok, why = check_kvstore_node(args.master, args.node_id,
                                         _client_tls(args.tls_dir, "kvstore-node"))
        else:
            ok, why = check_process(args.pid)
    except (LookupError, ValueError, OSError) as exc:
        ok, why = False, str(exc)
    if not args.quiet:
        print(("healthy: " if ok else "unhealthy: ") + why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
