"""`pdserve serve kvstore-master | kvstore-node | kvstore` (master and one node in one process).

`add_kvstore_subcommands(subparsers)` adds them to `pdserve serve`'s subparsers; each sets
`func`, which runs the service until SIGTERM/SIGINT and returns the exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from pdserve.services.common.tls_args import add_tls_args, tls_from_args


def add_kvstore_subcommands(subparsers) -> None:
    master = subparsers.add_parser("kvstore-master", help="KV store master (metadata in Redis)")
    _master_args(master)
    master.set_defaults(func=_run_master)
    node = subparsers.add_parser("kvstore-node", help="KV store storage node")
    _node_args(node, master_flag=True)
    node.set_defaults(func=_run_node)
    both = subparsers.add_parser("kvstore", help="KV store master and one storage node")
    _master_args(both)
    _node_args(both, master_flag=False)
    both.set_defaults(func=_run_both)
    for p in (master, node, both):
        add_tls_args(p)


def _master_args(p: argparse.ArgumentParser) -> None:
    from pdserve.services.kvstore.config import MasterConfig

    d = MasterConfig()  # the one source of every default
    p.add_argument("--host", default=d.host,
                   help="address the master's gRPC server binds")
    p.add_argument("--port", type=int, default=d.port, help="master gRPC port")
    p.add_argument("--redis-url", default=d.redis_url,
                   help="redis URL; with a password, prefer --redis-url-file (argv is public)")
    p.add_argument("--redis-url-file", default=d.redis_url_file,
                   help="file holding the redis URL with its password (wins over --redis-url)")
    p.add_argument("--namespace", default=d.namespace,
                   help="Redis key prefix of this store's metadata")
    p.add_argument("--replica-num", type=int, default=d.replica_num,
                   help="copies of each object across nodes")
    p.add_argument("--high-watermark", type=float, default=d.high_watermark,
                   help="a node fuller than this share evicts ...")
    p.add_argument("--low-watermark", type=float, default=d.low_watermark,
                   help="... down to this share")
    p.add_argument("--node-timeout", type=float, default=d.node_timeout_s,
                   help="seconds without a heartbeat before a node (and its replicas) is dropped")
    p.add_argument("--put-timeout", type=float, default=d.put_timeout_s,
                   help="seconds before an unfinished put is revoked")
    p.add_argument("--read-lease", type=float, default=d.read_lease_s,
                   help="seconds a lookup renews an object's lease (and its read grants last)")
    p.add_argument("--max-lease", type=float, default=d.max_lease_s,
                   help="longest lease a put may ask for, seconds")
    p.add_argument("--max-node-capacity-gib", type=int, default=d.max_node_capacity >> 30,
                   help="largest segment a node may register")
    p.add_argument("--store-secret-file", default=d.store_secret_file,
                   help="file with the secret shared by master and nodes "
                        "(default: $PDSERVE_KV_STORE_SECRET_FILE; none: unauthenticated)")


def _node_args(p: argparse.ArgumentParser, master_flag: bool) -> None:
    from pdserve.services.kvstore.config import NodeConfig

    d = NodeConfig()
    if master_flag:
        p.add_argument("--master", default=d.master_addr, help="master host:port")
        p.add_argument("--host", default=d.host,
                       help="address the node announces and binds")
        p.add_argument("--store-secret-file", default=d.store_secret_file,
                       help="file with the secret shared by master and nodes")
    p.add_argument("--node-port", type=int, default=d.port, help="transport port; 0 -> free")
    p.add_argument("--capacity-mib", type=int, default=d.capacity >> 20, help="segment size")
    p.add_argument("--node-id", default=d.node_id,
                   help="this node's name at the master (default: host name)")
    p.add_argument("--transport", choices=["auto", "ucx", "tcp"], default=d.transport,
                   help="how engines reach this node's segment (auto: UCX where available)")
    p.add_argument("--grant-skew", type=float, default=d.grant_skew_s,
                   help="seconds of clock difference with the master a capability tolerates")


def _master_cfg(args):
    from pdserve.services.kvstore.config import MasterConfig

    return MasterConfig(host=args.host, port=args.port, redis_url=args.redis_url,
                        redis_url_file=args.redis_url_file,
                        namespace=args.namespace, replica_num=args.replica_num,
                        high_watermark=args.high_watermark, low_watermark=args.low_watermark,
                        node_timeout_s=args.node_timeout, put_timeout_s=args.put_timeout,
                        read_lease_s=args.read_lease, max_lease_s=args.max_lease,
                        max_node_capacity=args.max_node_capacity_gib << 30,
                        store_secret_file=args.store_secret_file,
                        tls=tls_from_args(args, "kvstore-master"))


def _node_tls(args):
    """A node's certificate: its own role's from --tls-dir; in `kvstore` (master and node in
    one process) with single files, the master's (the master accepts its own role)."""
    if args.tls_dir or args.service != "kvstore":
        return tls_from_args(args, "kvstore-node")
    return tls_from_args(args, "kvstore-master")


def _node_cfg(args, master_addr: str):
    from pdserve.services.kvstore.config import NodeConfig

    return NodeConfig(master_addr=master_addr, host=args.host, port=args.node_port,
                      capacity=args.capacity_mib << 20, node_id=args.node_id,
                      transport=args.transport, store_secret_file=args.store_secret_file,
                      grant_skew_s=args.grant_skew, tls=_node_tls(args))


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _serve(master_cfg, node_args) -> None:
    from pdserve.services.kvstore.master_service import start_master
    from pdserve.services.kvstore.node import start_node

    master = await start_master(master_cfg) if master_cfg is not None else None
    node = None
    try:
        if node_args is not None:
            addr = (f"{master_cfg.host}:{master.port}" if master is not None
                    else node_args.master)
            node = await start_node(_node_cfg(node_args, addr))
            print(f"kvstore node {node.node_id} at {node.address}", flush=True)
        if master is not None:
            print(f"kvstore master at {master_cfg.host}:{master.port}", flush=True)
        await _until_signal()
    finally:
        if node is not None:
            await node.stop()
        if master is not None:
            await master.stop()


def _setup() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch = sys.modules.get("torch")  # the store never imports torch itself; if a plugin
    if torch is not None:  # did, keep its thread pool off the engines' cores
        torch.set_num_threads(1)


def _run_master(args) -> int:
    _setup()
    asyncio.run(_serve(_master_cfg(args), None))
    return 0


def _run_node(args) -> int:
    _setup()
    asyncio.run(_serve(None, args))
    return 0


def _run_both(args) -> int:
    _setup()
    asyncio.run(_serve(_master_cfg(args), args))
    return 0


def main(argv=None) -> int:
    """`python -m pdserve.services.kvstore.cli kvstore ...` without the top-level CLI."""
    parser = argparse.ArgumentParser(prog="pdserve serve")
    add_kvstore_subcommands(parser.add_subparsers(dest="service", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
