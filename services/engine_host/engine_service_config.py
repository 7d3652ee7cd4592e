"""Settings of one engine instance service (prefill, decode or unified), validated up front."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pdserve.common.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.services.common.tls import TlsConfig
from pdserve.services.engine_host.health import ROLES
from pdserve.services.engine_host.kv_connector_factory import ROLE_TO_KV, KVStoreSettings
from pdserve.services.registry.config import Registration


@dataclass(frozen=True)
class EngineServiceConfig:
    role: str = "unified"
    host: str = "127.0.0.1"
    port: int = 50051  # 0 -> any free port
    model: str = "smollm2"
    tiny_seed: int = 0
    num_threads: int = 1
    cpus: tuple[int, ...] = ()  # pin the process to these cores; () -> leave as is
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    itl_target_ms: float = 0.0  # > 0: adapt the step token budget to this step time
    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_cache_bytes: Optional[int] = None
    memory_budget_bytes: Optional[int] = None  # weights + activations + KV; KV gets the rest
    enable_prefix_caching: bool = True
    max_pending_outputs: int = 8  # per stream, before outputs are merged for a slow reader
    # How long the event loop thread may hold the GIL while the engine thread waits for it
    # (sys.setswitchinterval; Python's default is 5 ms). The engine thread needs the GIL
    # between every two torch ops of a forward, and the loop thread streams the previous
    # step's outputs meanwhile: at 5 ms each wait could stall the forward for 5 ms.
    gil_switch_interval_ms: float = 0.5
    grace_s: float = 2.0  # on shutdown, how long calls in flight may finish
    drain_timeout_s: float = 30.0  # on SIGTERM, how long running requests may finish
    kv_store: str = ""  # KV store master host:port; "" -> no KV connector
    kv_transport: str = "auto"  # how to reach the storage nodes: auto | ucx | tcp
    kv_lease_s: float = 30.0  # stored blocks are not evicted for this long
    kv_load_timeout_s: float = 10.0  # a slower load is given up and recomputed
    kv_reuse: bool = True  # prefill also loads from the store, decode saves finished requests
    kv_layer_segments: int = 1  # stored objects per KV block, each a run of layers (> 1: streamed)
    # every tensor-parallel rank moves its own KV heads (docs/parallelism.md, "Per-rank transfers")
    kv_per_rank: bool = KVStoreSettings.per_rank
    kv_block_secret_file: str = ""  # keys/MACs of stored blocks (docs/kvstore-security.md)
    metrics_port: int = 0  # Prometheus /metrics over HTTP on `host`; 0 -> no endpoint
    otlp_endpoint: str = ""  # OTLP/gRPC trace collector; "" -> $OTEL_EXPORTER_OTLP_ENDPOINT
    device: str = "cpu"  # "cuda" (or "cuda:N") runs the engine on a GPU
    attention_backend: str = "auto"  # auto | torch | triton (auto: triton on CUDA)
    cpu_gemm: str = "auto"  # auto | onednn | torch (auto: oneDNN prepacked on a CPU that has it)
    host_heap: str = EngineConfig.host_heap  # keep | release (common/host_heap.py)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # tensor parallel workers
    # the gRPC server: the largest message each way, and the RPCs served at once (more get
    # RESOURCE_EXHAUSTED); docs/hardening.md
    grpc_max_message_bytes: int = 4 * 1024 * 1024
    grpc_max_concurrent_rpcs: int = 2048
    weights: str = EngineConfig.weights  # packed | fp32 (quantized GGUF matrices kept packed)
    dtype: str = EngineConfig.dtype  # auto | float32 | bfloat16 | float16 (weights, activations)
    kv_cache_dtype: str = EngineConfig.kv_cache_dtype  # auto | float32 | bfloat16 | float16
    tls: TlsConfig = TlsConfig()  # mutual TLS on the gRPC port; empty -> plaintext
    registration: Registration = Registration()  # the instance registry; default: none

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if any(c < 0 for c in self.cpus):
            raise ValueError(f"cpus must be core indices >= 0, got {self.cpus}")
        if not 0 <= self.itl_target_ms < 1e6:
            raise ValueError(f"itl_target_ms must be in [0, 1e6), got {self.itl_target_ms}")
        if not 0.01 <= self.gil_switch_interval_ms <= 100:
            raise ValueError(f"gil_switch_interval_ms must be in [0.01, 100], got "
                             f"{self.gil_switch_interval_ms}")
        if self.max_pending_outputs < 1:
            raise ValueError(f"max_pending_outputs must be >= 1, got {self.max_pending_outputs}")
        if self.grpc_max_message_bytes < 1 or self.grpc_max_concurrent_rpcs < 1:
            raise ValueError("grpc_max_message_bytes and grpc_max_concurrent_rpcs must be >= 1")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        self.engine_config()  # the engine's own checks, now rather than after startup
        self.kv_settings()

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                              kv_cache_bytes=self.kv_cache_bytes,
                              memory_budget_bytes=self.memory_budget_bytes,
                              enable_prefix_caching=self.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=self.max_model_len),
            num_threads=self.num_threads,
            tiny_model_seed=self.tiny_seed,
            device=self.device,
            attention_backend=self.attention_backend,
            cpu_gemm=self.cpu_gemm,
            host_heap=self.host_heap,
            parallel=self.parallel,
            weights=self.weights,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def kv_settings(self) -> Optional[KVStoreSettings]:
        """The connector's settings: prefill produces, decode consumes, unified does both."""
        if not self.kv_store:
            return None
        return KVStoreSettings(self.kv_store, ROLE_TO_KV[self.role], self.kv_transport,
                               lease_s=self.kv_lease_s, load_timeout_s=self.kv_load_timeout_s,
                               block_secret_file=self.kv_block_secret_file, tls=self.tls,
                               reuse=self.kv_reuse, layer_segments=self.kv_layer_segments,
                               per_rank=self.kv_per_rank)
