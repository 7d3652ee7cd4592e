"""`pdserve bench offline`: our engine vs Hugging Face transformers' batched `generate`, same
prompts, same thread count, in one run, with the fp32 matmul ceiling measured in the same run.

Ceiling (the issue's definition): the workload's matmul FLOPs (prompt tokens x 2 x non-embedding
matmul parameters, plus output tokens x 2 x all matmul parameters including the LM head) at the
fp32 matmul rate measured at the model's own shapes (prefill shapes for prompt FLOPs, decode
shapes for output FLOPs) with torch's fp32 `linear`, the matmul transformers runs on.
ceiling_fraction = that ideal time / our time.

Beside it, a stricter ceiling at the fastest fp32 GEMM this machine offers (oneDNN's prepacked
GEMM where available, which the engine itself uses): ceiling_fraction_fastest_gemm. Both GEMMs
are measured over every layer's own weights. Figures are medians over --repeats runs; the last
line printed is one JSON object.

--weights both (the default) runs the engine twice per repeat, with a GGUF's quantized matrices
kept packed and expanded to fp32 (docs/packed-weights.md), and prints packed_vs_fp32 (fp32 time /
packed time), each engine's resident weight bytes and the KV blocks each gets for the same
--memory-budget-bytes.

The engine timed is the one `pdserve serve` / `pdserve up` runs with the same flags
(bench/offline_engine.py: its EngineConfig comes from EngineServiceConfig, so --max-num-seqs,
--max-num-batched-tokens, --max-model-len, --cpu-gemm, --no-prefix-caching and the weights
default alike); the headline `pdserve_output_tok_s` is the first --weights mode's (packed with
`both`), and the JSON's `engine` says the settings. Against a stack started with `--weights
fp32`, give `--weights fp32` here too.

--kv-cache-dtype bfloat16|float16 runs the engines with a half KV cache (docs/half-precision.md)
and, in the same repeats, an fp32-KV engine with the first weights mode as its peer: it prints
half_kv_vs_fp32_kv (fp32-KV time / half-KV time) and ceiling_fraction_fastest_gemm_fp32_kv.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdserve.common.config import DTYPES, KV_CACHE_DTYPES, ModelConfig


def add_offline_subcommand(sub) -> None:
    p = sub.add_parser("offline", help="offline throughput vs transformers and the fp32 ceiling")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1", action="store_true", help="single-stream decode: one prompt "
                   "at a time (uses --num-prompts prompts, default 4 in this mode)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    from pdserve.bench.offline_engine import add_served_engine_args
    add_served_engine_args(p)  # the served engine's settings, same defaults (offline_engine)
    p.add_argument("--skip-hf", action="store_true", help="only our engine (no ratio)")
    p.add_argument("--weights", choices=["both", "packed", "fp32"], default="both",
                   help="engine weights: packed GGUF blocks, fp32, or both side by side")
    p.add_argument("--memory-budget-bytes", type=int, default=1 << 30,
                   help="weights + KV budget for the KV-blocks comparison (not allocated)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the engines' unquantized weights and activations (auto: fp32 on CPU)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the engines' KV cache type; a half type adds an fp32-KV peer engine")
    p.add_argument("--seed", type=int, default=0)
    from pdserve.common.engine.cli import add_parallel_args
    add_parallel_args(p)  # T x P > 1: vs TP=1 with T x P x --num-threads threads (offline_tp)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (the default); > 0 samples at this temperature, as "
                   "served requests do (OpenAI's default is 1.0), both engines alike")
    p.set_defaults(func=run_offline)


def matmul_shapes(cfg: ModelConfig) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(out, in) of the per-layer matmuls, and of the LM head."""
    d, h = cfg.head_dim, cfg.hidden_size
    layer = [((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), (h, cfg.num_heads * d),
             (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    return layer, (cfg.vocab_size, h)


def matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """(non-embedding matmul parameters, LM head parameters)."""
    layer, head = matmul_shapes(cfg)
    return cfg.num_layers * sum(o * i for o, i in layer), head[0] * head[1]


def measure_rate(cfg: ModelConfig, m: int, with_head: bool, gemm: str = "torch",
                 repeats: int = 3) -> float:
    """fp32 matmul FLOP/s over one forward's worth of the model's matmuls at M = m rows: every
    layer's own weights (so they stream from memory as in the real forward; one layer's would
    sit in the L3 cache and flatter the rate), with torch's `linear` (MKL) or oneDNN's
    prepacked GEMM (what the engine uses; cpu_gemm.py)."""
    import torch  # heavy: imported when the bench runs, not when `--help` builds the parser

    from pdserve.common.models.cpu_gemm import pack_weight, packed_linear
    layer, head = matmul_shapes(cfg)
    shapes = layer * cfg.num_layers + ([head] if with_head else [])
    if gemm == "onednn":
        ws = [(pack_weight(torch.randn(o, i)), i) for o, i in shapes]
        mm = lambda x, w: packed_linear(x, w[0], None)  # noqa: E731
    else:
        ws = [(torch.randn(o, i), i) for o, i in shapes]
        mm = lambda x, w: torch.nn.functional.linear(x, w[0])  # noqa: E731
    xs = {i: torch.randn(m, i) for _, i in shapes}
    flops = sum(2 * m * o * i for o, i in shapes)
    times = []
    for r in range(repeats + 1):
        t = time.perf_counter()
        for w in ws:
            mm(xs[w[1]], w)
        if r:  # the first pass warms up
            times.append(time.perf_counter() - t)
    return flops / statistics.median(times)


def best_rate(cfg: ModelConfig, m: int, with_head: bool) -> dict[str, float]:
    """Rates of every fp32 GEMM this machine offers: torch's (the ceiling) and oneDNN's."""
    from pdserve.common.models.cpu_gemm import onednn_available
    gemms = ["torch"] + (["onednn"] if onednn_available() else [])
    return {g: measure_rate(cfg, m, with_head, g) for g in gemms}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(n)]


def run_ours(llm, prompts, output_len: int, batch1: bool, temperature: float = 0.0) -> float:
    from pdserve.common.sampling_params import SamplingParams
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    llm.engine.pool.reset_prefix_cache()  # every repeat computes its prompts
    t = time.perf_counter()
    groups = [[p] for p in prompts] if batch1 else [prompts]
    n_out = sum(len(o.token_ids) for g in groups for o in llm.generate(g, params))
    if n_out != len(prompts) * output_len:
        raise RuntimeError(f"expected {len(prompts) * output_len} tokens, got {n_out}")
    return time.perf_counter() - t


def build_hf(loaded):
    from pdserve.bench.hf_peer import hf_model_from_loaded
    return hf_model_from_loaded(loaded)


def run_hf(hf, prompts, output_len: int, batch1: bool, temperature: float = 0.0) -> float:
    from pdserve.bench.hf_peer import hf_generate
    t = time.perf_counter()
    groups = [[p] for p in prompts] if batch1 else [prompts]
    for g in groups:
        hf_generate(hf, g, output_len, temperature)
    return time.perf_counter() - t


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU as /proc/cpuinfo names it, with its family, model and widest vector ISA, e.g.
    "AMD EPYC (family 26 model 2, avx512)": a VM's model name alone ("AMD EPYC") does not
    tell Zen 3 from Zen 5, and benchmark figures are only comparable on one CPU (platform's
    answer where there is no /proc/cpuinfo)."""
    import platform
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "flags"):
                    fields.setdefault(key, value.strip())
                elif not key and fields:
                    break  # the first processor's block is enough
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    flags = fields.get("flags", "").split()
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    fam = (f"family {fields['cpu family']} model {fields['model']}, "
           if "cpu family" in fields and "model" in fields else "")
    return f"{fields['model name']} ({fam}{isa})"


def weights_modes(choice: str) -> list[str]:
    return ["packed", "fp32"] if choice == "both" else [choice]


def run_offline(args) -> int:
    import dataclasses

    from pdserve.bench.offline_engine import check_fits, served_engine_config
    from pdserve.common.engine.llm import LLM
    from pdserve.common.models.registry import expand_weights, load_model
    import torch

    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        from pdserve.bench.offline_tp import run_offline_tp
        return run_offline_tp(args)
    torch.set_num_threads(args.num_threads)
    n_prompts = 4 if args.batch1 and args.num_prompts == 64 else args.num_prompts
    modes = weights_modes(args.weights)
    loaded = {m: load_model(args.model, weights=m) for m in modes}
    cfg = loaded[modes[0]].config
    prompts = random_prompts(n_prompts, args.input_len, cfg.vocab_size, args.seed)
    concurrency = 1 if args.batch1 else n_prompts

    def engine(m: str, kv_dtype: str):
        config = served_engine_config(args, m, kv_dtype, concurrency,
                                      args.input_len + args.output_len)
        check_fits(config, args.input_len, args.output_len)
        return LLM(config, loaded=loaded[m])

    llms = {m: engine(m, args.kv_cache_dtype) for m in modes}
    half_kv = args.kv_cache_dtype in ("bfloat16", "float16")
    fp32_kv = engine(modes[0], "float32") if half_kv else None
    ours_fp32_kv: list[float] = []
    hf = None if args.skip_hf else build_hf(dataclasses.replace(
        loaded[modes[0]], weights=expand_weights(loaded[modes[0]].weights)))
    ours: dict[str, list[float]] = {m: [] for m in modes}
    theirs = []
    prefill_only: list[float] = []  # --batch1: the prompts with one output token each
    prefill_only_fp32_kv: list[float] = []  # the same on the fp32-KV peer (half KV asked)
    t = args.temperature
    for _ in range(args.repeats):  # interleaved, so drift hits all alike
        for m in modes:
            ours[m].append(run_ours(llms[m], prompts, args.output_len, args.batch1, t))
        if args.batch1:
            prefill_only.append(run_ours(llms[modes[0]], prompts, 1, True, t))
        if fp32_kv is not None:
            ours_fp32_kv.append(run_ours(fp32_kv, prompts, args.output_len, args.batch1, t))
            if args.batch1:
                prefill_only_fp32_kv.append(run_ours(fp32_kv, prompts, 1, True, t))
        if hf is not None:
            theirs.append(run_hf(hf, prompts, args.output_len, args.batch1, t))
    extra = weights_report(args, cfg, llms, ours, n_prompts * args.output_len)
    extra["kv_cache_dtype"] = str(llms[modes[0]].engine.kv_dtype).removeprefix("torch.")
    extra["dtype"] = args.dtype
    if ours_fp32_kv:
        extra["fp32_kv_s"] = statistics.median(ours_fp32_kv)
        extra["half_kv_vs_fp32_kv"] = extra["fp32_kv_s"] / statistics.median(ours[modes[0]])
    extra["engine"] = engine_settings(llms[modes[0]].engine.config)
    if prefill_only:
        extra.update(decode_split(ours[modes[0]], prefill_only, n_prompts, args.output_len))
    if prefill_only_fp32_kv:  # batch 1 with a half KV cache: the fp32-KV decode rate beside it
        split = decode_split(ours_fp32_kv, prefill_only_fp32_kv, n_prompts, args.output_len)
        extra["fp32_kv_decode_tok_s"] = split["decode_tok_s"]
    report(args, cfg, n_prompts, concurrency, ours[modes[0]], theirs, extra)
    return 0


def decode_split(full: list[float], prefill_only: list[float], n_prompts: int,
                 output_len: int) -> dict:
    """Batch 1: the decode steps alone, as llama.cpp's peer reports them (bench/llama_cpp_peer):
    each repeat's time less the same prompts' time with one output token (prefill and the
    first token), over the n_prompts x (output_len - 1) decode steps; medians over repeats."""
    decode = statistics.median(f - p for f, p in zip(full, prefill_only))
    steps = n_prompts * (output_len - 1)
    return {"prefill_s": statistics.median(prefill_only), "decode_s": decode,
            "decode_tok_s": steps / decode if decode > 0 else None}


def engine_settings(config) -> dict:
    """The timed engine's settings that decide a step's work (the JSON line says them, so a
    served run can be matched against it)."""
    sc = config.scheduler
    return {"weights": config.weights, "cpu_gemm": config.cpu_gemm,
            "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_model_len": sc.max_model_len, "block_size": config.cache.block_size,
            "enable_prefix_caching": config.cache.enable_prefix_caching,
            "num_threads": config.num_threads}


def weights_report(args, cfg, llms, ours, n_out: int) -> dict:
    """Per weights mode: time, rate, resident weight bytes, KV blocks for the same budget."""
    from pdserve.common.kv.dtype import kv_bytes_per_token
    from pdserve.common.kv.memory import plan_kv_blocks
    from pdserve.common.models.quant.cpu_native import load_packed_kernels
    by = {}
    for m, llm in llms.items():
        fp = llm.engine.weights_footprint
        t = statistics.median(ours[m])
        per_token = kv_bytes_per_token(cfg.kv_bytes_per_token, llm.engine.kv_dtype)
        blocks = plan_kv_blocks(per_token, 16, weights=fp,
                                memory_budget_bytes=args.memory_budget_bytes).num_blocks
        by[m] = {"s": t, "output_tok_s": n_out / t,
                 "weights_resident_mib": fp.resident_bytes / 2**20,
                 "weights_fp32_mib": fp.fp32_bytes / 2**20, "kv_blocks_for_budget": blocks}
    native = load_packed_kernels()
    res = {"cpu": cpu_name(), "packed_kernel_simd": native.simd if native else None,
           "weights": list(llms), "by_weights": by,
           "memory_budget_mib": args.memory_budget_bytes / 2**20}
    if {"packed", "fp32"} <= set(by):
        res["packed_vs_fp32"] = by["fp32"]["s"] / by["packed"]["s"]
    return res


def report(args, cfg, n_prompts, concurrency, ours, theirs, extra: dict) -> None:
    body, head = matmul_params(cfg)
    n_in, n_out = n_prompts * args.input_len, n_prompts * args.output_len
    prefill_m = min(extra["engine"]["max_num_batched_tokens"], concurrency * args.input_len)
    rates_prefill = best_rate(cfg, prefill_m, with_head=False)
    rates_decode = best_rate(cfg, concurrency, with_head=True)

    def ideal_s(rate_prefill: float, rate_decode: float) -> float:
        return n_in * 2 * body / rate_prefill + n_out * 2 * (body + head) / rate_decode

    # the issue's ceiling: torch's fp32 matmul; the stricter one: the fastest GEMM measured
    fast_prefill = max(rates_prefill, key=rates_prefill.get)
    fast_decode = max(rates_decode, key=rates_decode.get)
    ideal = ideal_s(rates_prefill["torch"], rates_decode["torch"])
    ideal_fast = ideal_s(rates_prefill[fast_prefill], rates_decode[fast_decode])
    t_ours = statistics.median(ours)
    res = {
        "model": args.model, "num_prompts": n_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "batch1": args.batch1, "num_threads": args.num_threads,
        "temperature": args.temperature,
        "repeats": args.repeats,
        "pdserve_s": t_ours, "pdserve_output_tok_s": n_out / t_ours,
        "matmul_gflops_prefill": rates_prefill["torch"] / 1e9,
        "matmul_gflops_decode": rates_decode["torch"] / 1e9,
        "ceiling_output_tok_s": n_out / ideal, "ceiling_fraction": ideal / t_ours,
        "matmul_gflops": {"prefill": {g: r / 1e9 for g, r in rates_prefill.items()},
                          "decode": {g: r / 1e9 for g, r in rates_decode.items()}},
        "fastest_gemm": {"prefill": fast_prefill, "decode": fast_decode},
        "ceiling_fastest_gemm_output_tok_s": n_out / ideal_fast,
        "ceiling_fraction_fastest_gemm": ideal_fast / t_ours,
    }
    if theirs:
        t_hf = statistics.median(theirs)
        res.update(hf_s=t_hf, hf_output_tok_s=n_out / t_hf, ratio=t_hf / t_ours)
    res.update(extra or {})
    if "fp32_kv_s" in res:
        res["ceiling_fraction_fastest_gemm_fp32_kv"] = ideal_fast / res["fp32_kv_s"]
    rows = [("engine", "time s", "output tok/s"),
            ("pdserve", f"{t_ours:.2f}", f"{n_out / t_ours:.1f}")]
    if theirs:
        rows.append(("transformers", f"{res['hf_s']:.2f}", f"{res['hf_output_tok_s']:.1f}"))
    rows.append(("fp32 ceiling", f"{ideal:.2f}", f"{n_out / ideal:.1f}"))
    rows.append(("(fastest GEMM)", f"{ideal_fast:.2f}", f"{n_out / ideal_fast:.1f}"))
    for m, b in (extra or {}).get("by_weights", {}).items():
        rows.append((f"  {m} weights", f"{b['s']:.2f}", f"{b['output_tok_s']:.1f}"))
    for r in rows:
        print(f"{r[0]:<16}{r[1]:>10}{r[2]:>14}")
    for m, b in (extra or {}).get("by_weights", {}).items():
        print(f"{m}: weights {b['weights_resident_mib']:.1f} MiB resident "
              f"({b['weights_fp32_mib']:.1f} MiB as fp32); KV blocks in a "
              f"{args.memory_budget_bytes / 2**20:.0f} MiB budget: {b['kv_blocks_for_budget']}")
    if extra and "packed_vs_fp32" in extra:
        print(f"ratio packed/fp32 weights (fp32 time / packed time): "
              f"{extra['packed_vs_fp32']:.2f}")
    if extra:
        print(f"cpu: {extra['cpu']} (packed kernel: {extra['packed_kernel_simd']}), "
              f"threads {args.num_threads}")
    e = extra["engine"]
    print(f"pdserve's row: the engine `pdserve serve` runs with weights {e['weights']}, "
          f"max_num_seqs {e['max_num_seqs']}, max_num_batched_tokens "
          f"{e['max_num_batched_tokens']}, prefix caching "
          f"{'on' if e['enable_prefix_caching'] else 'off'}, cpu_gemm {e['cpu_gemm']}")
    if theirs:
        print(f"ratio pdserve/transformers: {res['ratio']:.2f}")
    if res.get("decode_tok_s"):
        print(f"batch 1, {e['weights']} weights: prefill + first token {res['prefill_s']:.2f} s, "
              f"decode steps alone {res['decode_s']:.2f} s = {res['decode_tok_s']:.1f} tok/s"
              f" ({res['kv_cache_dtype']} KV)")
    if res.get("fp32_kv_decode_tok_s"):
        print(f"batch 1, fp32 KV: decode steps alone {res['fp32_kv_decode_tok_s']:.1f} tok/s")
    if "fp32_kv_s" in res:
        print(f"KV cache {res['kv_cache_dtype']}: {t_ours:.2f} s; "
              f"fp32 KV: {res['fp32_kv_s']:.2f} s; ratio {res['kv_cache_dtype']}/fp32 KV "
              f"(fp32-KV time / half-KV time): "
              f"{res['half_kv_vs_fp32_kv']:.2f}; ceiling fraction (fastest GEMM) with fp32 KV: "
              f"{res['ceiling_fraction_fastest_gemm_fp32_kv']:.2f}")
    print(f"ceiling fraction: {res['ceiling_fraction']:.2f}  (torch's fp32 matmul, GFLOP/s "
          f"prefill {rates_prefill['torch'] / 1e9:.0f}, decode {rates_decode['torch'] / 1e9:.0f});"
          f" against the fastest GEMM ({fast_prefill} {rates_prefill[fast_prefill] / 1e9:.0f}, "
          f"{fast_decode} {rates_decode[fast_decode] / 1e9:.0f}): "
          f"{res['ceiling_fraction_fastest_gemm']:.2f}")
    print(json.dumps(res), flush=True)
