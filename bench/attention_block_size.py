"""CPU batch decode attention at several KV block sizes, one kernel, in one process, alternated
per round: does a longer contiguous run per block (vLLM's CPU backend uses 128 tokens) let the
scattered-page read go faster? (bench/attention_cpu.py's case: SmolLM2 shapes, pages scattered,
caches cycled so K/V come from memory.)

    python -m pdserve.bench.attention_block_size --block-sizes 16,32,64,128 \
        --kv-dtypes bfloat16,float32 --num-threads 2

Prints per block size the median of the per-round medians, the K/V read rate and the ratio to
the first block size (> 1: faster than it), the CPU, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.bench.attention_cpu import HEAD_DIM, KV_DTYPES, KV_HEADS, make_case
from pdserve.bench.offline import cpu_name
from pdserve.common.attention.cpu_native import load_cpu_kernels


def round_ms(module, case, out, reps: int) -> float:
    """Median ms of reps calls, each on the next cache copy."""
    caches, query, meta = case
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        module.paged_decode(query, caches[i % len(caches)], meta.block_tables, meta.seq_lens,
                            HEAD_DIM ** -0.5, out, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def compare(module, sizes: list[int], batch: int, ctx: int, dtype: str, rounds: int,
            reps: int) -> list[dict]:
    """One row per block size (each its own random case: same shapes and context, not the same
    values; the work per call does not depend on them)."""
    cases = [make_case(batch, ctx, dtype=KV_DTYPES[dtype], block=bs) for bs in sizes]
    out = torch.empty_like(cases[0][1])  # [B, h, d]
    for case in cases:  # warm-up
        round_ms(module, case, out, 1)
    ms: list[list[float]] = [[] for _ in sizes]
    for r in range(rounds):  # forward, backward, ...: every size sees the same drift
        order = range(len(sizes)) if r % 2 == 0 else reversed(range(len(sizes)))
        for i in order:
            ms[i].append(round_ms(module, cases[i], out, reps))
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * KV_DTYPES[dtype].itemsize
    first = statistics.median(ms[0])
    return [dict(block_size=bs, kv_dtype=dtype, batch=batch, ctx=ctx,
                 ms=round(statistics.median(m), 4),
                 gbps=round(kv_bytes / statistics.median(m) / 1e6, 1),
                 speedup_vs_first=round(first / statistics.median(m), 3),
                 rounds=[round(x, 3) for x in m]) for bs, m in zip(sizes, ms)]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-sizes", default="16,32,64,128")
    ap.add_argument("--kv-dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=320)
    args = ap.parse_args(argv)
    for n in ("rounds", "reps", "num_threads", "batch"):
        if not 1 <= getattr(args, n) <= 4096:
            raise ValueError(f"--{n.replace('_', '-')} must be in [1, 4096]")
    if not 1 <= args.ctx <= 32768:
        raise ValueError("--ctx must be in [1, 32768]")
    args.block_sizes = [int(b) for b in args.block_sizes.split(",")]
    if not all(b in (8, 16, 32, 64, 128, 256) for b in args.block_sizes):
        raise ValueError("--block-sizes must be powers of two in [8, 256]")
    args.kv_dtypes = args.kv_dtypes.split(",")
    if not set(args.kv_dtypes) <= set(KV_DTYPES):
        raise ValueError(f"--kv-dtypes must name some of {', '.join(KV_DTYPES)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads)
    module = load_cpu_kernels()
    if module is None:
        raise SystemExit("native kernels unavailable (PDSERVE_NO_NATIVE=1 or build failed)")
    rows = [row for dt in args.kv_dtypes
            for row in compare(module, args.block_sizes, args.batch, args.ctx, dt, args.rounds,
                               args.reps)]
    cpu = cpu_name()
    print(f"cpu: {cpu}, threads {args.num_threads}")
    for r in rows:
        print(f"B {r['batch']} ctx {r['ctx']} {r['kv_dtype']} block {r['block_size']}: "
              f"{r['ms']:.3f} ms ({r['gbps']} GB/s), vs block {args.block_sizes[0]} "
              f"{r['speedup_vs_first']:.3f}x; rounds {r['rounds']}")
    print(json.dumps({"bench": "attention_block_size", "cpu": cpu, "threads": args.num_threads,
                      "rows": rows}))


if __name__ == "__main__":
    main()
