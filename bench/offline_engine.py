"""The engine `pdserve bench offline` times is the one an engine service would run with the same
flags: its EngineConfig comes from `EngineServiceConfig(...).engine_config()`, so every setting
the user does not give (batch limits, prefix caching, block size, CPU GEMM, weights, dtypes)
takes the service's default from that one dataclass. Only the KV cache's size differs: offline
sizes it to the workload (`num_blocks`) where a service plans it from free memory; that changes
no step's work.

The flags' defaults are None ("the service's"), resolved here when the bench runs, so building
`pdserve --help` does not import the service layer (and torch with it).
"""

from __future__ import annotations

import argparse
from typing import Optional

from pdserve.common.config import EngineConfig, ParallelConfig

SERVED = "None: the engine service's default, EngineServiceConfig's"


def add_served_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine settings `pdserve serve decode` / `pdserve up` also take, same names."""
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"sequences in one engine batch at most ({SERVED})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens one engine step computes at most ({SERVED})")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"longest prompt + completion in tokens ({SERVED})")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per KV cache block ({SERVED})")
    p.add_argument("--cpu-gemm", choices=["auto", "onednn", "torch"], default=None,
                   help=f"CPU linears: oneDNN prepacked or torch's matmul ({SERVED})")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="no automatic prefix caching, as `pdserve up --no-prefix-caching`")
    from pdserve.common.engine.cli import add_host_heap_arg
    add_host_heap_arg(p, None, f" ({SERVED})")


def served_engine_config(args, weights: str, kv_cache_dtype: str, concurrency: int,
                         tokens_per_request: int, num_threads: Optional[int] = None,
                         parallel: Optional[ParallelConfig] = None) -> EngineConfig:
    """The EngineConfig an engine service builds from `args`' engine flags, with `weights`,
    `kv_cache_dtype`, and a KV cache that holds `concurrency` requests of `tokens_per_request`
    tokens each (see the module docstring)."""
    from pdserve.services.engine_host.engine_service_config import EngineServiceConfig

    block = args.block_size or EngineServiceConfig.block_size
    tokens = concurrency * tokens_per_request
    num_blocks = -(-tokens // block) + 2 * concurrency + 16  # + partial blocks, + slack

    given = {name: value for name, value in (
        ("max_num_seqs", args.max_num_seqs),
        ("max_num_batched_tokens", args.max_num_batched_tokens),
        ("max_model_len", args.max_model_len), ("block_size", args.block_size),
        ("cpu_gemm", args.cpu_gemm), ("host_heap", args.host_heap),
        ("parallel", parallel)) if value is not None}
    service = EngineServiceConfig(
        model=args.model, num_threads=num_threads or args.num_threads, weights=weights,
        dtype=args.dtype, kv_cache_dtype=kv_cache_dtype, num_blocks=num_blocks,
        enable_prefix_caching=not args.no_prefix_caching, **given)
    return service.engine_config()


def check_fits(cfg: EngineConfig, input_len: int, output_len: int) -> None:
    """A prompt and its completion must fit the engine's max_model_len (a served engine would
    refuse the request with a 400)."""
    if input_len + output_len > cfg.scheduler.max_model_len:
        raise ValueError(f"--input-len + --output-len = {input_len + output_len} exceeds "
                         f"max_model_len {cfg.scheduler.max_model_len}: raise --max-model-len")
