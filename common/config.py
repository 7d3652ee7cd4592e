"""Frozen, validated configuration dataclasses.

Each config validates itself in `__post_init__` and raises `ValueError` naming the field and the
allowed range. Core structures (block pool, scheduler, runner) take primitives, not these configs;
the configs exist at the edges (CLI, services, `LLM`) to carry and check settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

RopeScalingType = Literal["none", "linear", "llama3"]
AttentionBackendName = Literal["auto", "torch", "triton"]
WEIGHTS_MODES = ("packed", "fp32")  # GGUF-quantized matrices kept packed, or expanded at load
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # common/kv/dtype.py
DTYPES = ("auto", "float32", "bfloat16", "float16")  # common/models/dtype.py
HOST_HEAP_MODES = ("keep", "release")  # common/host_heap.py


def _require(cond: bool, name: str, allowed: str, value) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling, as in Hugging Face `rope_scaling`."""

    type: RopeScalingType = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only

    def __post_init__(self):
        _require(self.type in ("none", "linear", "llama3"), "rope_scaling.type",
                 "one of none, linear, llama3", self.type)
        _require(self.factor > 0, "rope_scaling.factor", "> 0", self.factor)
        if self.type == "llama3":
            _require(self.high_freq_factor > self.low_freq_factor > 0,
                     "rope_scaling.high_freq_factor", "> low_freq_factor > 0",
                     (self.low_freq_factor, self.high_freq_factor))
            _require(self.original_max_position > 0, "rope_scaling.original_max_position",
                     "> 0", self.original_max_position)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM, Mistral-like, Qwen2 via qkv_bias)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 variant
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, "> 0", getattr(self, name))
        if self.head_dim == 0:
            _require(self.hidden_size % self.num_heads == 0, "hidden_size",
                     "divisible by num_heads", self.hidden_size)
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _require(self.head_dim > 0 and self.head_dim % 2 == 0, "head_dim", "even and > 0",
                 self.head_dim)
        _require(self.num_heads % self.num_kv_heads == 0, "num_heads",
                 f"a multiple of num_kv_heads ({self.num_kv_heads})", self.num_heads)
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "> 0", self.rms_norm_eps)
        _require(self.rope_theta > 0, "rope_theta", "> 0", self.rope_theta)
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizing. Exactly one of kv_cache_bytes / kv_cache_fraction decides the budget."""

    block_size: int = 16
    kv_cache_bytes: Optional[int] = None
    kv_cache_fraction: float = 0.25  # of free host memory, when kv_cache_bytes is None
    memory_budget_bytes: Optional[int] = None  # weights + KV; the KV gets what weights leave
    num_blocks: Optional[int] = None  # overrides both (tests)
    enable_prefix_caching: bool = True

    def __post_init__(self):
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 "block_size", "a power of two", self.block_size)
        if self.kv_cache_bytes is not None:
            _require(self.kv_cache_bytes > 0, "kv_cache_bytes", "> 0", self.kv_cache_bytes)
        if self.memory_budget_bytes is not None:
            _require(self.memory_budget_bytes > 0 and self.kv_cache_bytes is None,
                     "memory_budget_bytes", "> 0 and not given with kv_cache_bytes",
                     self.memory_budget_bytes)
        _require(0 < self.kv_cache_fraction <= 0.95, "kv_cache_fraction", "in (0, 0.95]",
                 self.kv_cache_fraction)
        if self.num_blocks is not None:
            _require(self.num_blocks > 0, "num_blocks", "> 0", self.num_blocks)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        _require(self.max_num_seqs > 0, "max_num_seqs", "> 0", self.max_num_seqs)
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "> 0",
                 self.max_num_batched_tokens)
        _require(self.max_model_len > 1, "max_model_len", "> 1", self.max_model_len)
        if not self.enable_chunked_prefill:
            _require(self.max_num_batched_tokens >= self.max_model_len,
                     "max_num_batched_tokens", ">= max_model_len without chunked prefill",
                     self.max_num_batched_tokens)


AllReduceName = Literal["auto", "shm", "gloo"]


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine spreads its model over processes (docs/parallelism.md).

    tensor_parallel_size: ranks that each hold 1/T of every layer's heads and features (and of
    the KV cache); the engine process is rank 0 and starts T-1 workers.
    pipeline_parallel_size: stages that each hold a contiguous run of the decoder layers (and
    their KV cache); each stage is a tensor-parallel group of tensor_parallel_size ranks, so the
    engine runs T x P processes.
    all_reduce: how CPU ranks sum partial results: "shm" (shared memory between the ranks on
    this host), "gloo" (torch.distributed), "auto" (shm on the CPU, the group's backend on
    CUDA).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    all_reduce: AllReduceName = "auto"

    def __post_init__(self):
        _require(1 <= self.tensor_parallel_size <= 64, "tensor_parallel_size", "in [1, 64]",
                 self.tensor_parallel_size)
        _require(1 <= self.pipeline_parallel_size <= 64, "pipeline_parallel_size",
                 "in [1, 64]", self.pipeline_parallel_size)
        _require(self.world_size <= 64, "tensor_parallel_size x pipeline_parallel_size",
                 "<= 64", self.world_size)
        _require(self.all_reduce in ("auto", "shm", "gloo"), "all_reduce",
                 "one of auto, shm, gloo", self.all_reduce)

    @property
    def world_size(self) -> int:
        """Processes of one engine (rank 0 is the engine process)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM` / `EngineCore` need: which model, how to cache, how to schedule."""

    model: str = "smollm2"  # "smollm2", "tiny", a GGUF file or a Hugging Face directory
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention_backend: AttentionBackendName = "auto"
    device: str = "cpu"
    cpu_gemm: str = "auto"  # auto | onednn | torch: how linears multiply on the CPU (cpu_gemm.py)
    weights: str = "packed"  # packed | fp32: quantized GGUF matrices stay packed (models/quant)
    dtype: str = "auto"  # unquantized weights and activations; auto: fp32 on CPU, bf16 on CUDA
    kv_cache_dtype: str = "auto"  # the KV cache's element type; auto = the activations' dtype
    num_threads: Optional[int] = None  # torch threads (per rank); None -> torch's default
    # keep | release: whether glibc keeps the memory a CPU step frees for the next step
    # (common/host_heap.py) or returns it to the kernel, which faults it in again next step
    host_heap: str = "keep"
    seed: int = 0
    tiny_model_seed: int = 0  # for model == "tiny"

    def __post_init__(self):
        _require(bool(self.model), "model", "a non-empty name or path", self.model)
        _require(self.attention_backend in ("auto", "torch", "triton"), "attention_backend",
                 "one of auto, torch, triton", self.attention_backend)
        _require(self.cpu_gemm in ("auto", "onednn", "torch"), "cpu_gemm",
                 "one of auto, onednn, torch", self.cpu_gemm)
        _require(self.weights in WEIGHTS_MODES, "weights", "one of packed, fp32", self.weights)
        _require(self.dtype in DTYPES, "dtype", "one of " + ", ".join(DTYPES), self.dtype)
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 "one of " + ", ".join(KV_CACHE_DTYPES), self.kv_cache_dtype)
        if self.num_threads is not None:
            _require(self.num_threads > 0, "num_threads", "> 0", self.num_threads)
        _require(self.host_heap in HOST_HEAP_MODES, "host_heap",
                 "one of " + ", ".join(HOST_HEAP_MODES), self.host_heap)
        _require(self.device == "cpu" or self.device.startswith("cuda"), "device",
                 "cpu, cuda or cuda:N", self.device)
