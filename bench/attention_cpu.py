"""CPU decode attention: torch gather + SDPA (torch_backend._decode) vs the native paged kernel.

SmolLM2-135M shapes (9 heads, 3 kv heads, head_dim 64, block size 16), batch {1, 16, 64} x context
{128, 320, 1024} x {1, 2} threads, for each cache dtype of --kv-dtypes (fp32 by default; a half
cache is the fp32 one rounded, read by both sides: SDPA's path widens the gathered K/V). Pages are scattered over the cache like a running engine's,
and each timed call uses the next of several cache copies (>= 3x a 32 MiB L3 in all) so K/V come
from memory, as they do when 30 layers take turns. Prints a table of median milliseconds, the
native kernel's achieved GB/s of K/V read (at the median), and one JSON line (with the mins too).

    .venv/bin/python -m pdserve.bench.attention_cpu [--reps 15] [--quick]
        [--kv-dtypes float32,bfloat16,float16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.common.attention.backend import AttentionMetadata
from pdserve.common.attention.cpu_native import load_cpu_kernels, paged_decode
from pdserve.common.attention.torch_backend import _decode

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
COLD_BYTES = 96 << 20  # cache copies cycled per config, so each call misses the L3


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_case(batch: int, ctx: int, seed: int = 0, dtype: torch.dtype = torch.float32,
              block: int = BLOCK):
    """Caches [copies] of [2, NB, block, kvh, d] in dtype, query [B, h, d] fp32, metadata;
    context exactly ctx."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    gen = torch.Generator().manual_seed(seed)
    per_req = -(-ctx // block)
    num_blocks = batch * per_req + 8
    one = 2 * num_blocks * block * KV_HEADS * HEAD_DIM * dtype.itemsize
    copies = max(1, min(8, -(-COLD_BYTES // one)))
    caches = [torch.randn(2, num_blocks, block, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
              for _ in range(copies)]
    tables = torch.randperm(num_blocks, generator=gen)[:batch * per_req].view(batch, per_req)
    tables = tables.int().contiguous()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=batch, num_decodes=batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=seq_lens,
        block_tables=tables, slot_mapping=torch.zeros(batch, dtype=torch.int64),
        max_query_len=1, max_seq_len=ctx, query_lens_cpu=[1] * batch,
        seq_lens_cpu=[ctx] * batch)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    return caches, query, meta


def time_ms(fn, caches, reps: int) -> tuple[float, float]:
    """(median, min) ms. The min is there because on a shared machine a thread preempted by
    another process stalls the others at OpenMP's barrier for a whole scheduler slice."""
    fn(caches[0])  # warm-up (allocator, thread pool)
    times = []
    for i in range(reps):
        cache = caches[i % len(caches)]
        t0 = time.perf_counter()
        fn(cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def run(reps: int, batches, contexts, threads, dtypes=("float32",)) -> list[dict]:
    if load_cpu_kernels() is None:
        raise SystemExit("native kernels unavailable (PDSERVE_NO_NATIVE=1 or build failed)")
    scale = HEAD_DIM ** -0.5
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        for b, ctx, dt in ((b, c, dt) for b in batches for c in contexts for dt in dtypes):
            dtype = KV_DTYPES[dt]
            caches, q, meta = make_case(b, ctx, dtype=dtype)
            out = torch.empty_like(q)
            ref, ref_min = time_ms(lambda c: _decode(q, c, meta, scale), caches, reps)
            nat, nat_min = time_ms(lambda c: paged_decode(q, c, meta.block_tables,
                                                          meta.seq_lens, scale, out=out),
                                   caches, reps)
            kv_bytes = 2 * b * ctx * KV_HEADS * HEAD_DIM * dtype.itemsize
            rows.append(dict(threads=nt, batch=b, ctx=ctx, kv_dtype=dt,
                             gather_sdpa_ms=round(ref, 4),
                             native_ms=round(nat, 4), speedup=round(ref / nat, 2),
                             native_gbps=round(kv_bytes / nat / 1e6, 2),
                             gather_sdpa_min_ms=round(ref_min, 4),
                             native_min_ms=round(nat_min, 4)))
            del caches
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="B 64, ctx 320 only")
    ap.add_argument("--kv-dtypes", default="float32",
                    help="comma-separated cache dtypes: float32, bfloat16, float16")
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    dtypes = tuple(args.kv_dtypes.split(","))
    if not dtypes or not set(dtypes) <= set(KV_DTYPES):
        raise ValueError(f"--kv-dtypes must name some of {', '.join(KV_DTYPES)}, "
                         f"got {args.kv_dtypes!r}")
    batches, contexts = ((64,), (320,)) if args.quick else ((1, 16, 64), (128, 320, 1024))
    rows = run(args.reps, batches, contexts, (1, 2), dtypes)
    print(f"{'thr':>3} {'B':>3} {'ctx':>5} {'kv':>8} {'gather+sdpa ms':>15} {'native ms':>10} "
          f"{'speedup':>8} {'native GB/s':>12}")
    for r in rows:
        print(f"{r['threads']:>3} {r['batch']:>3} {r['ctx']:>5} {r['kv_dtype']:>8} "
              f"{r['gather_sdpa_ms']:>15.3f} "
              f"{r['native_ms']:>10.3f} {r['speedup']:>8.2f} {r['native_gbps']:>12.2f}")
    print(json.dumps({"bench": "attention_cpu", "heads": HEADS, "kv_heads": KV_HEADS,
                      "head_dim": HEAD_DIM, "block_size": BLOCK, "rows": rows}))


if __name__ == "__main__":
    main()
