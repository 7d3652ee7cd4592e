"""Frozen, validated settings of the KV store master and storage nodes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from pdserve.services.common.tls import TlsConfig

GiB = 1 << 30


@dataclass(frozen=True)
class MasterConfig:
    host: str = "127.0.0.1"
    port: int = 50090
    redis_url: str = field(default="redis://127.0.0.1:6379/0", repr=False)
    redis_url_file: str = ""  # a file holding the URL (with its password): wins over redis_url
    namespace: str = "pdserve:kv"  # redis key prefix: several stores can share one redis
    replica_num: int = 1  # default copies per object
    high_watermark: float = 0.95  # a node fuller than this evicts ...
    low_watermark: float = 0.85  # ... down to this
    read_lease_s: float = 5.0  # a read renews the lease for this long (covers the transfer)
    put_timeout_s: float = 30.0  # a write not ended by then is revoked (crashed writer)
    heartbeat_interval_s: float = 1.0
    node_timeout_s: float = 5.0  # no heartbeat for this long -> the node and its replicas go
    sweep_interval_s: float = 0.5
    # Bounds on what a caller may ask for (checked at the gRPC edge, before any state changes).
    max_lease_s: float = 3600.0  # a PutStart lease above this is refused
    max_node_capacity: int = 1024 * GiB  # a RegisterNode claiming more is refused
    max_batch_keys: int = 8192  # keys per call: a 131k-token prompt at 16-token blocks
    # entries per BatchPutStart / BatchPutEnd / BatchPutRevoke: each entry of a BatchPutStart
    # places, may evict and is written to Redis under the master's one lock, so the bound is
    # well under max_batch_keys (a step's blocks fit: 1,024 x 16 tokens)
    max_batch_puts: int = 1024
    max_replicas: int = 8  # replica_num above this is refused
    max_concurrent_rpcs: int = 1024  # more wait in no queue: RESOURCE_EXHAUSTED
    # The store secret (docs/kvstore-security.md): "" -> $PDSERVE_KV_STORE_SECRET_FILE, and
    # with neither the store runs unauthenticated (a warning says so).
    store_secret_file: str = ""
    token_max_age_s: float = 60.0  # a registration/admin token older than this is refused
    tls: TlsConfig = TlsConfig()  # mutual TLS on the master's gRPC (plaintext when empty)

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if not 1 <= self.replica_num <= self.max_replicas:
            raise ValueError("replica_num must be in [1, max_replicas]")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark < high_watermark <= 1")
        for name in ("read_lease_s", "put_timeout_s", "heartbeat_interval_s",
                     "node_timeout_s", "sweep_interval_s", "max_lease_s", "token_max_age_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be positive and finite")
        for name in ("max_node_capacity", "max_batch_keys", "max_batch_puts",
                     "max_concurrent_rpcs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.node_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("node_timeout_s must exceed heartbeat_interval_s")


    def resolved_redis_url(self) -> str:
        """The URL to connect with: redis_url_file's content when set, else redis_url."""
        if not self.redis_url_file:
            return self.redis_url
        with open(self.redis_url_file, encoding="utf-8") as f:
            url = f.read(4096).strip()
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{self.redis_url_file} does not hold a redis:// URL")
        return url


def redact_url(url: str) -> str:
    """The URL without its password (for logs): redis://user:***@host:port/db."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


@dataclass(frozen=True)
class NodeConfig:
    master_addr: str = "127.0.0.1:50090"
    host: str = "127.0.0.1"
    port: int = 0  # 0 -> a free port
    capacity: int = 1 << 30  # segment bytes
    node_id: str = ""  # empty -> host:port
    transport: str = "auto"  # auto | ucx | tcp
    store_secret_file: str = ""  # as MasterConfig's; must hold the master's secret
    grant_skew_s: float = 2.0  # tolerated clock difference with the master on capabilities
    tls: TlsConfig = TlsConfig()  # the node's certificate for its channel to the master
    # TCP: each connection is served by a thread of its own (tcp_threads.py); more
    # connections than this are closed on accept, so threads stay bounded.
    max_connections: int = 512
    frame_timeout_s: float = 30.0  # TCP: a client silent this long mid-request is dropped

    def __post_init__(self):
        if self.capacity <= 0:
            raise ValueError("capacity must be positive")
        if not 1 <= self.max_connections <= 65536:
            raise ValueError("max_connections must be in [1, 65536]")
        if not 0 < self.frame_timeout_s <= 3600:
            raise ValueError("frame_timeout_s must be in (0, 3600]")
        if not 0 <= self.grant_skew_s <= 60:
            raise ValueError("grant_skew_s must be in [0, 60]")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.transport not in ("auto", "ucx", "tcp"):
            raise ValueError("transport must be auto, ucx or tcp")
        if ":" not in self.master_addr:
            raise ValueError("master_addr must be host:port")
