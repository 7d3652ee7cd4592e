"""Measure where the packed kernel stops beating expand-then-GEMM (quant/gemm.py's LARGE_M, per
kernel build: run it once per `PDSERVE_CPU_ISA`).

    flock /tmp/pdserve-bench.lock python -m pdserve.common.models.quant.crossover --num-threads 2

Times both CPU paths over one forward's worth of SmolLM2-shaped matrices of one type (`--qtype`,
Q4_1 by default; random blocks with small finite fp16 scales; every layer's own weights, so
they stream from memory as in the engine) at each M, medians of --repeats (the paths take
turns, pass by pass), and prints the smallest M from which expand-then-GEMM is faster at every
larger M measured; `--blocked` adds the expansion into oneDNN's blocked layout and where it
overtakes expand-then-GEMM (quant/gemm.py's BLOCKED_M). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from pdserve.bench.offline import cpu_name
from pdserve.common.engine.cli import add_host_heap_arg
from pdserve.common.host_heap import apply_host_heap
from pdserve.common.models.cpu_gemm import onednn_available, pack_weight
from pdserve.common.models.quant import gemm
from pdserve.common.models.quant.blocked import BlockedWeights
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.packed import PackedWeight, QType

# per-layer (out, in) of the fused q/k/v, o, gate/up and down projections. SmolLM2-135M's width
# 576 is no multiple of 256, so its K-quant files hold K-quants only where K = 1536 (down);
# SmolLM2-1.7B (2048 / 8192) is all whole super-blocks.
SHAPES = {"smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
          "smollm2-1.7b": [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]}



def _weights(qtype: QType, layers: int, shapes) -> list[PackedWeight]:
    rng = np.random.default_rng(0)
    rb, bs = qtype.block_bytes, qtype.block_size
    return [PackedWeight(qtype, torch.from_numpy(
        rng.integers(0, 256, (n, k // bs * rb), dtype=np.uint8)), k)
        for _ in range(layers) for n, k in shapes]


def _fix_scales(ws: list[PackedWeight]) -> None:
    """Random bytes include NaN/inf fp16 scales; make every d (+2^-7) and min (-2^-7) finite."""
    for w in ws:
        blocks = w.data.view(w.out_features, -1, w.qtype.block_bytes)
        for i, off in enumerate(w.qtype.half_offsets):
            blocks[..., off:off + 2] = torch.tensor([0x00, 0x20 if i == 0 else 0xA0],
                                                    dtype=torch.uint8)


def time_paths(native, ws, m: int, repeats: int, fp32=None, blocked=None) -> dict[str, float]:
    """Median seconds for one pass over `ws` by each path, the paths taking turns pass by
    pass (so a drift of the machine's speed moves them alike): the packed kernel, expand +
    GEMM, and with `fp32` (the weights expanded beforehand) the fp32 GEMM the --weights fp32
    path runs, with `blocked` (a BlockedWeights) the expansion into oneDNN's layout + GEMM."""
    xs = {k: torch.randn(m, k) for k in {w.in_features for w in ws}}
    paths = {"packed": lambda x, i, w: native.packed_gemm(x, w.data, int(w.qtype)),
             "expand_gemm": lambda x, i, w: gemm._expand_then_gemm(native, x, w, None, None)}
    if fp32 is not None:
        paths["fp32"] = lambda x, i, w: gemm._fp32_gemm(x, fp32[i], None)
    if blocked is not None:
        paths["blocked"] = lambda x, i, w: gemm._fp32_gemm(x, blocked.expand(w), None)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(repeats + 1):
        for name, path in paths.items():
            t = time.perf_counter()
            for i, w in enumerate(ws):
                path(xs[w.in_features], i, w)
            if r:  # the first pass warms up
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


def from_m(rows: list[dict], faster: str, slower: str):
    """The smallest M from which path `faster` beats `slower` at every larger M measured."""
    return next((r["m"] for i, r in enumerate(rows)
                 if all(s[faster] < s[slower] for s in rows[i:])), None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--qtype", choices=[q.name for q in QType], default="Q4_1")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--fp32", action="store_true",
                   help="also time the fp32 GEMM on weights expanded beforehand (fp32 path)")
    p.add_argument("--blocked", action="store_true",
                   help="also time the expansion into oneDNN's blocked layout + GEMM "
                   "(quant/blocked.py; the smallest M from which it beats expand + GEMM is "
                   "quant/gemm.py's BLOCKED_M)")
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48, 64, 128, 256])
    add_host_heap_arg(p)  # as the engine: expand + GEMM's transient weight reuses memory
    args = p.parse_args()
    torch.set_num_threads(args.num_threads)
    apply_host_heap(args.host_heap)
    native = load_packed_kernels()
    if native is None:
        raise SystemExit("the packed kernels did not build")
    ws = _weights(QType[args.qtype], args.layers, SHAPES[args.shapes])
    _fix_scales(ws)
    # the fp32 path's weights: expanded at load and, with oneDNN, reordered once (prepacked)
    prepack = pack_weight if onednn_available() else (lambda t: t)
    fp32 = [prepack(gemm.expand(w)) for w in ws] if args.fp32 else None
    blocked = BlockedWeights(native) if args.blocked else None
    rows = []
    for m in args.m:
        t = {k: v * 1e3 for k, v in time_paths(native, ws, m, args.repeats, fp32,
                                                 blocked).items()}
        rows.append({"m": m, **{f"{k}_ms": v for k, v in t.items()}})
        line = (f"M={m:<5} packed {t['packed']:9.2f} ms   expand+GEMM {t['expand_gemm']:9.2f} ms"
                f"   ratio {t['expand_gemm'] / t['packed']:5.2f}")
        if fp32 is not None:
            line += f"   fp32 GEMM {t['fp32']:9.2f} ms   fp32/packed {t['fp32'] / t['packed']:5.2f}"
        if blocked is not None:
            line += (f"   blocked {t['blocked']:9.2f} ms   blocked/expand+GEMM "
                     f"{t['blocked'] / t['expand_gemm']:5.3f}")
        print(line, flush=True)
    cross = from_m(rows, "expand_gemm_ms", "packed_ms")
    blocked_from = from_m(rows, "blocked_ms", "expand_gemm_ms") if blocked else None
    print(f"cpu: {cpu_name()}, simd {native.simd}, threads "
          f"{args.num_threads}, host heap {args.host_heap}, {args.qtype} {args.shapes} x "
          f"{args.layers}; expand+GEMM faster "
          f"from M = {cross}" + (f"; blocked faster than expand+GEMM from M = {blocked_from}"
                                 if blocked else ""))
    print(json.dumps({"simd": native.simd, "num_threads": args.num_threads,
                      "host_heap": args.host_heap,
                      "qtype": args.qtype, "shapes": args.shapes,
                      "crossover_m": cross, "blocked_from_m": blocked_from, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
