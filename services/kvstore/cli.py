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


def _master_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50090, help="master gRPC port")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--namespace", default="pdserve:kv")
    p.add_argument("--replica-num", type=int, default=1)
    p.add_argument("--high-watermark", type=float, default=0.95)
    p.add_argument("--low-watermark", type=float, default=0.85)
    p.add_argument("--node-timeout", type=float, default=5.0)


def _node_args(p: argparse.ArgumentParser, master_flag: bool) -> None:
    if master_flag:
        p.add_argument("--master", default="127.0.0.1:50090", help="master host:port")
        p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--node-port", type=int, default=0, help="transport port; 0 -> free")
    p.add_argument("--capacity-mib", type=int, default=1024, help="segment size")
    p.add_argument("--node-id", default="")
    p.add_argument("--transport", choices=["auto", "ucx", "tcp"], default="auto")


def _master_cfg(args):
    from pdserve.services.kvstore.config import MasterConfig

    return MasterConfig(host=args.host, port=args.port, redis_url=args.redis_url,
                        namespace=args.namespace, replica_num=args.replica_num,
                        high_watermark=args.high_watermark, low_watermark=args.low_watermark,
                        node_timeout_s=args.node_timeout)


def _node_cfg(args, master_addr: str):
    from pdserve.services.kvstore.config import NodeConfig

    return NodeConfig(master_addr=master_addr, host=args.host, port=args.node_port,
                      capacity=args.capacity_mib << 20, node_id=args.node_id,
                      transport=args.transport)


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
