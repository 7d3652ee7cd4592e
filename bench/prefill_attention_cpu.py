"""CPU prefill attention: torch's SDPA one request at a time (torch_backend._prefill_one, the
path before the native kernel) vs the native paged prefill kernel (all chunks in one call).

SmolLM2-135M shapes (9 heads, 3 kv heads, head_dim 64, block size 16). Cases: whole prompts of
256 / 1024 / 2048 tokens (8 / 2 / 1 of them: one 2048-token step each), and 256-token chunks
after a 768-token cached prefix (the extend path; SDPA gathers the prefix first). Both sides
read the same scattered paged cache. Prints median milliseconds, the ratio and the native
kernel's GFLOP/s (causal FLOPs: 4 * d * heads per (query, visible key) pair), then one JSON line.
--kv-dtypes runs every case on each cache dtype (the fp32 cache rounded; SDPA's path widens).

    .venv/bin/python -m pdserve.bench.prefill_attention_cpu [--reps 7] [--threads 2]
        [--kv-dtypes float32,bfloat16,float16]
"""

from __future__ import annotations

import argparse
import json

import torch

from pdserve.bench.attention_cpu import KV_DTYPES, time_ms
from pdserve.common.attention.cpu_native import load_cpu_kernels
from pdserve.common.attention.torch_backend import prefill_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [("prompt 256 x8", 256, 0, 8), ("prompt 1024 x2", 1024, 0, 2),
         ("prompt 2048 x1", 2048, 0, 1), ("extend 256 after 768 x8", 256, 768, 8)]


def make_case(chunk: int, prefix: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ctx = prefix + chunk
    per_req = -(-ctx // BLOCK)
    num_blocks = n * per_req + 8
    kv = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:n * per_req].view(n, per_req).int()
    query = torch.randn(n * chunk, HEADS, HEAD_DIM, generator=gen)
    qsl = torch.arange(0, n * chunk + 1, chunk, dtype=torch.int32)
    lens = torch.full((n,), ctx, dtype=torch.int32)
    return query, kv, tables.contiguous(), lens, qsl


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtypes", default="float32",
                    help="comma-separated cache dtypes: float32, bfloat16, float16")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.threads < 1:
        raise ValueError("--reps and --threads must be >= 1")
    dtypes = tuple(args.kv_dtypes.split(","))
    if not set(dtypes) <= set(KV_DTYPES):
        raise ValueError(f"--kv-dtypes must name some of {', '.join(KV_DTYPES)}, "
                         f"got {args.kv_dtypes!r}")
    torch.set_num_threads(args.threads)
    native = load_cpu_kernels()
    if native is None or not native.fast_prefill:
        raise SystemExit("native prefill kernel unavailable (no AVX2, no compiler, or "
                         "PDSERVE_NO_NATIVE=1)")
    scale = HEAD_DIM ** -0.5
    rows = []
    for (name, chunk, prefix, n), dt in ((c, dt) for c in CASES for dt in dtypes):
        query, kv, tables, lens, qsl = make_case(chunk, prefix, n)
        kv = kv.to(KV_DTYPES[dt])
        out = torch.empty_like(query)
        # one cache: a prefill reads K/V the same layer's step has just written
        sdpa, _ = time_ms(lambda c: prefill_reference(query, c, tables, lens, qsl, 0, scale),
                          [kv], args.reps)
        nat, _ = time_ms(lambda c: native.paged_prefill(query, c, tables, lens, qsl, 0, scale,
                                                        out), [kv], args.reps)
        pairs = n * sum(prefix + i + 1 for i in range(chunk))  # (query, visible key) pairs
        rows.append(dict(case=name, kv_dtype=dt, sdpa_ms=round(sdpa, 3), native_ms=round(nat, 3),
                         speedup=round(sdpa / nat, 2),
                         native_gflops=round(4 * HEAD_DIM * HEADS * pairs / nat / 1e6, 1)))
    print(f"{'case':<26} {'kv':>8} {'sdpa ms':>9} {'native ms':>10} {'speedup':>8} "
          f"{'GFLOP/s':>8}")
    for r in rows:
        print(f"{r['case']:<26} {r['kv_dtype']:>8} {r['sdpa_ms']:>9.2f} {r['native_ms']:>10.2f} "
              f"{r['speedup']:>8.2f} {r['native_gflops']:>8.1f}")
    print(json.dumps({"bench": "prefill_attention_cpu", "threads": args.threads,
                      "simd": native.simd, "rows": rows}))


if __name__ == "__main__":
    main()
