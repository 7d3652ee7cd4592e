"""A live KV store for attacker and deadline tests: redis-server, a master and storage nodes
in their own processes, sharing a store secret (and, with `tls_dir`, on mutual TLS);
everything stops on exit, failure included."""

import contextlib
import secrets
import sys
import threading

import grpc

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.common.rpc import kvstore_pb2_grpc as pb_grpc
from pdserve.services.common.tls import TlsConfig, open_channel
from pdserve.services.kvstore.redis_proc import RedisProcess
from pdserve.services.launcher import Child, free_port, wait_until

KV = [sys.executable, "-m", "pdserve.services.kvstore.cli"]


def _channel(addr: str, tls_dir: str):
    """A blocking channel to the master: plaintext, or TLS with the router's certificate."""
    tls = TlsConfig.from_dir(tls_dir, "router") if tls_dir else TlsConfig()
    return open_channel(addr, tls, "kvstore-master", aio=False)


def node_addresses(master_addr: str, tls_dir: str = "") -> dict[str, str]:
    """node id -> transport address, as the master's Stats says ({} when unreachable)."""
    with _channel(master_addr, tls_dir) as ch:
        try:
            stats = pb_grpc.KVStoreMasterStub(ch).Stats(pb.StatsRequest(), timeout=1)
        except grpc.RpcError:
            return {}
        return {n.node_id: n.address for n in stats.nodes}


def _master_up(addr: str, tls_dir: str = "") -> bool:
    with _channel(addr, tls_dir) as ch:
        try:
            pb_grpc.KVStoreMasterStub(ch).Stats(pb.StatsRequest(), timeout=1)
            return True
        except grpc.RpcError:
            return False


@contextlib.contextmanager
def secured_cluster(tmp_path, nodes: int = 1, master_args=(), node_args=(), tls_dir: str = ""):
    """(master address, store secret file, {node id: Child}, master Child)."""
    tls = ["--tls-dir", tls_dir] if tls_dir else []
    secret = tmp_path / "store.secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    children = []
    with RedisProcess() as redis:
        try:
            port = free_port("127.0.0.1")
            maddr = f"127.0.0.1:{port}"
            master = Child("master", KV + ["kvstore-master", "--port", str(port),
                                           "--redis-url", redis.url, "--store-secret-file",
                                           str(secret), *tls, *master_args], tmp_path)
            master.start()
            children.append(master)
            wait_until(lambda: _master_up(maddr, tls_dir), master, 60, threading.Event())
            started = {}
            for i in range(nodes):
                node = Child(f"n{i}", KV + ["kvstore-node", "--master", maddr, "--node-id",
                                            f"n{i}", "--capacity-mib", "8", "--transport",
                                            "tcp", "--store-secret-file", str(secret),
                                            *tls, *node_args], tmp_path)
                node.start()
                children.append(node)
                started[f"n{i}"] = node
                wait_until(lambda: f"n{i}" in node_addresses(maddr, tls_dir), node, 60,
                           threading.Event())
            yield maddr, secret, started, master
        finally:
            for child in reversed(children):
                child.stop(5.0)
