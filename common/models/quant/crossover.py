"""Measure where the packed kernel stops beating expand-then-GEMM (quant/gemm.py's LARGE_M).

    flock /tmp/pdserve-cpu.lock python -m pdserve.common.models.quant.crossover --num-threads 2

Times both CPU paths over one forward's worth of SmolLM2-shaped Q4_1 matrices (every layer's
own weights, so they stream from memory as in the engine) at each M, medians of --repeats, and
prints the smallest M from which expand-then-GEMM is faster at every larger M measured; the
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from pdserve.common.models.quant import gemm
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.packed import PackedWeight, QType

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2's per-layer (out, in)


def _weights(layers: int) -> list[PackedWeight]:
    rng = np.random.default_rng(0)
    rb = QType.Q4_1.block_bytes
    return [PackedWeight(QType.Q4_1, torch.from_numpy(
        rng.integers(0, 256, (n, k // 32 * rb), dtype=np.uint8)), k)
        for _ in range(layers) for n, k in SHAPES]


def _fix_scales(ws: list[PackedWeight]) -> None:
    """Random bytes include NaN/inf fp16 scales; make every d and m a small finite fp16."""
    for w in ws:
        blocks = w.data.view(w.out_features, -1, QType.Q4_1.block_bytes)
        blocks[..., 0:4] = torch.tensor([0x00, 0x20, 0x00, 0xA0], dtype=torch.uint8)


def time_path(native, ws, m: int, large: bool, repeats: int) -> float:
    xs = {k: torch.randn(m, k) for _, k in SHAPES}
    times = []
    for r in range(repeats + 1):
        t = time.perf_counter()
        for w in ws:
            x = xs[w.in_features]
            if large:
                gemm._expand_then_gemm(native, x, w, None, None)
            else:
                native.packed_gemm(x, w.data, int(w.qtype))
        if r:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48, 64, 128, 256])
    args = p.parse_args()
    torch.set_num_threads(args.num_threads)
    native = load_packed_kernels()
    if native is None:
        raise SystemExit("the packed kernels did not build")
    ws = _weights(args.layers)
    _fix_scales(ws)
    rows = []
    for m in args.m:
        packed = time_path(native, ws, m, False, args.repeats)
        expand = time_path(native, ws, m, True, args.repeats)
        rows.append({"m": m, "packed_ms": packed * 1e3, "expand_gemm_ms": expand * 1e3})
        print(f"M={m:<5} packed {packed * 1e3:9.2f} ms   expand+GEMM {expand * 1e3:9.2f} ms   "
              f"ratio {expand / packed:5.2f}", flush=True)
    cross = next((r["m"] for i, r in enumerate(rows)
                  if all(s["expand_gemm_ms"] < s["packed_ms"] for s in rows[i:])), None)
    print(f"cpu: {platform.processor() or platform.machine()}, simd {native.simd}, threads "
          f"{args.num_threads}; expand+GEMM faster from M = {cross}")
    print(json.dumps({"simd": native.simd, "num_threads": args.num_threads,
                      "crossover_m": cross, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
