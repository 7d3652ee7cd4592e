"""Builds an engine's KV connector over the KV store (services/kvstore) from service settings.

Lifecycle: `connector_factory(settings)` returns the callable EngineCore calls once it knows
its KV geometry. With `settings.per_rank` the engine also gets `rank_kv_factory(settings)`
(every tensor-parallel rank opens its own store client from the same settings and moves its
own KV heads; docs/parallelism.md, "Per-rank transfers") and the connector is the per-rank
mode's (connector/rank_connector.py). That call starts the connector's I/O thread and creates the store client ON
that thread's loop (grpc.aio channels bind to the loop they were made on); nothing connects
yet, so a store that is down only costs recomputation later. `engine.close()` ->
`connector.close()` closes the client on its loop, then stops the thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pdserve.connector.codec import BlockCodec
from pdserve.connector.io_thread import IOThread
from pdserve.connector.kvstore.client import KVStoreClient, StoreClientConfig
from pdserve.connector.rank_connector import RankKVConnector
from pdserve.connector.rank_kv_factory import RankTransfersFactory
from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector
from pdserve.services.common.tls import TlsConfig, open_channel

# The engine service's role -> what its connector does with the store.
ROLE_TO_KV = {"prefill": "producer", "decode": "consumer", "unified": "both"}


@dataclass(frozen=True)
class KVStoreSettings:
    master_addr: str  # the KV store master, host:port
    role: str  # producer | consumer | both
    transport: str = "auto"  # auto | ucx | tcp, to reach the storage nodes
    lease_s: float = 30.0
    load_timeout_s: float = 10.0
    lookup_timeout_s: float = 2.0
    max_inflight: int = 8
    block_secret_file: str = ""  # keys/MACs of stored blocks; "" -> $PDSERVE_KV_BLOCK_SECRET_FILE
    tls: TlsConfig = TlsConfig()  # this engine's certificate for the master's gRPC
    reuse: bool = True  # KV reuse (docs/kv-reuse.md): prefill loads, decode saves too
    layer_segments: int = ConnectorConfig.layer_segments  # objects per block (segments.py)
    per_rank: bool = ConnectorConfig.per_rank  # every TP rank moves its own KV heads

    def __post_init__(self):
        host, sep, port = self.master_addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"kv_store must be host:port, got {self.master_addr!r}")
        if self.transport not in ("auto", "ucx", "tcp"):
            raise ValueError(f"kv_transport must be auto, ucx or tcp, got {self.transport!r}")
        self.connector_config()  # its own range checks, now
        self.store_client_config()

    def connector_config(self) -> ConnectorConfig:
        return ConnectorConfig(role=self.role, lease_s=self.lease_s,
                               load_timeout_s=self.load_timeout_s,
                               max_inflight=self.max_inflight, reuse=self.reuse,
                               layer_segments=self.layer_segments, per_rank=self.per_rank)

    def store_client_config(self) -> StoreClientConfig:
        """The store client's deadlines and block secret (docs/kvstore-security.md)."""
        return StoreClientConfig(transport=self.transport,
                                 lookup_timeout_s=self.lookup_timeout_s,
                                 block_secret_file=self.block_secret_file)

    def open_master_channel(self, address: str):
        """The channel to the master: mutual TLS with this engine's certificate when on."""
        return open_channel(address, self.tls, "kvstore-master")

    async def open_client(self) -> KVStoreClient:
        """A store client bound to the running loop (grpc.aio channels bind to the loop they
        were made on), its block keys read from the secret file now. The settings hold paths,
        never secret material, so they can be pickled to another process (a tensor-parallel
        worker, docs/parallelism.md "Per-rank transfers") that opens its own client."""
        return KVStoreClient.for_engines(self.master_addr, self.store_client_config(),
                                         self.open_master_channel)


class _OwnsStoreClient:
    """A connector that also owns its store client, so closing it closes the client."""

    def close(self) -> None:
        try:
            self.io.run(self.store.close(), 5.0)
        except Exception:  # already broken or timed out: the thread stops anyway
            pass
        super().close()


class ServiceKVConnector(_OwnsStoreClient, StoreKVConnector):
    pass


class ServiceRankKVConnector(_OwnsStoreClient, RankKVConnector):
    pass


def _codec(engine, mac_key: bytes = b"") -> BlockCodec:
    cfg = engine.model_config
    return BlockCodec(engine.fingerprint, cfg.num_layers, engine.config.cache.block_size,
                      cfg.num_kv_heads, cfg.head_dim, dtype=engine.kv_dtype, mac_key=mac_key)


def rank_kv_factory(settings: KVStoreSettings) -> Callable:
    """EngineCore's `rank_kv`: the picklable factory every rank builds its transfers from
    (the settings hold paths only; each rank reads the block secret itself)."""
    def build(engine) -> RankTransfersFactory:
        return RankTransfersFactory(settings, _codec(engine), settings.lease_s,
                                    settings.load_timeout_s, settings.max_inflight)

    return build


def connector_factory(settings: KVStoreSettings) -> Callable:
    def build(engine) -> StoreKVConnector:
        if settings.per_rank and engine.rank_kv is None:
            raise ValueError("per_rank needs the engine built with rank_kv_factory(settings)")
        io = IOThread()

        try:
            client = io.run(settings.open_client(), 30.0)
        except BaseException:
            io.close()
            raise
        codec = _codec(engine, client.mac_key)
        if settings.per_rank:
            return ServiceRankKVConnector(client, codec, settings.connector_config(),
                                          engine.rank_kv, io)
        return ServiceKVConnector(client, codec, settings.connector_config(), io)

    return build
