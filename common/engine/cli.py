"""`pdserve generate`: offline generation from the command line."""

from __future__ import annotations

import argparse
import json
import logging

from pdserve.common.config import (DTYPES, HOST_HEAP_MODES, KV_CACHE_DTYPES, WEIGHTS_MODES,
                                  CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig)
from pdserve.common.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, tiny, a GGUF file or HF dir")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cpu-gemm", choices=["auto", "onednn", "torch"], default="auto",
                   help="CPU linears: oneDNN prepacked (auto when available) or torch's matmul")
    add_weights_arg(p)
    add_host_heap_arg(p)
    p.add_argument("--num-threads", type=int, default=2, help="torch threads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--kv-cache-fraction", type=float, default=0.2)
    p.add_argument("--memory-budget-bytes", type=int, default=None,
                   help="weights + KV cache; the KV gets what the resident weights leave")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    add_parallel_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """The ParallelConfig flags (generate, bench offline and the engine services share them);
    defaults come from ParallelConfig."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=ParallelConfig.tensor_parallel_size,
                   help="processes the model is split across (heads, features, vocabulary); "
                        "--num-threads is per process")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int,
                   default=ParallelConfig.pipeline_parallel_size,
                   help="pipeline stages, each a contiguous run of the layers on "
                        "--tensor-parallel-size processes (T x P processes in all)")
    p.add_argument("--tp-all-reduce", choices=["auto", "shm", "gloo"],
                   default=ParallelConfig.all_reduce,
                   help="how CPU ranks sum partial results: shared memory (auto) or gloo")


def parallel_config(args) -> ParallelConfig:
    return ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size,
                          all_reduce=args.tp_all_reduce)


def parallel_argv(args) -> list[str]:
    """The flags of add_parallel_args as command-line words (launchers pass them on)."""
    return ["--tensor-parallel-size", str(args.tensor_parallel_size),
            "--pipeline-parallel-size", str(args.pipeline_parallel_size),
            "--tp-all-reduce", args.tp_all_reduce]


def add_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=WEIGHTS_MODES, default=EngineConfig.weights,
                   help="packed: a GGUF's Q4_0..Q8_0, IQ4_NL/IQ4_XS and Q2_K..Q6_K matrices "
                   "stay packed in memory and multiply in fp32 (docs/packed-weights.md); fp32: "
                   "expand them at load")
    p.add_argument("--dtype", choices=DTYPES, default=EngineConfig.dtype,
                   help="unquantized weights and activations (auto: float32 on the CPU, "
                   "bfloat16 on CUDA; docs/half-precision.md)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   default=EngineConfig.kv_cache_dtype,
                   help="the KV cache's element type; attention widens it to fp32 as it reads "
                   "(auto: the activations' dtype, fp32; docs/half-precision.md)")


def add_host_heap_arg(p: argparse.ArgumentParser, default: str | None = EngineConfig.host_heap,
                      default_help: str = "") -> None:
    p.add_argument("--host-heap", choices=HOST_HEAP_MODES, default=default,
                   help="keep: glibc keeps the memory a CPU step frees for the next step "
                   "(the process stays at its activation peak, which the KV plan budgets "
                   "for); release: glibc's defaults, which hand large blocks back to the "
                   "kernel and fault them in again every step (docs/served-performance.md, "
                   "\"The C heap\")" + default_help)


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, attention_backend=args.attention_backend, device=args.device,
        cpu_gemm=args.cpu_gemm, weights=args.weights, num_threads=args.num_threads,
        host_heap=args.host_heap, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        cache=CacheConfig(block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
                          kv_cache_fraction=args.kv_cache_fraction,
                          memory_budget_bytes=args.memory_budget_bytes,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len),
        parallel=parallel_config(args))


def add_generate_subcommand(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline with the engine")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from pdserve.common.engine.llm import LLM
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, stop=tuple(args.stop), logprobs=args.logprobs)
    llm = LLM(engine_config(args))
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outs):
        if args.json:
            rec = {"prompt": prompt, "prompt_token_ids": out.prompt_token_ids,
                   "token_ids": out.token_ids, "text": out.text,
                   "finish_reason": out.finish_reason.value if out.finish_reason else None}
            if out.logprobs is not None:
                rec["logprobs"] = [lp.logprob for lp in out.logprobs]
            print(json.dumps(rec), flush=True)
        else:
            print(out.text, flush=True)
    return 0
