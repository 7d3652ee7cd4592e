"""CPU batch decode attention of two kernel source trees, in one process, alternated per round:
a decode-attention kernel change's A/B (bench/attention_cpu.py's case: SmolLM2 shapes, scattered
pages, caches cycled so K/V come from memory).

    mkdir /tmp/base && git archive main common/attention/cpu_kernels | tar -x -C /tmp/base
    python -m pdserve.bench.attention_ab --a /tmp/base/common/attention/cpu_kernels \
        --rounds 7 --num-threads 2 --kv-dtypes float32,bfloat16

--a and --b are cpu_kernels directories (--b defaults to this checkout's); --b-flags adds
compile flags to b's build (e.g. -DPDSERVE_K_AHEAD=4 to try a prefetch distance). Each is built
into its own module, cached by source hash and flags like the engine's. Why one process: on the
shared 2-core VM one process's timings moved by 10-15% from the next one's. Prints per-round
medians, the medians of those, a / b (> 1: b is faster), whether the outputs are bit-equal,
the CPU, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pdserve.bench.attention_cpu import HEAD_DIM, KV_DTYPES, KV_HEADS, make_case
from pdserve.bench.offline import cpu_name
from pdserve.common.attention import cpu_native

SOURCE_NAMES = tuple(p.name for p in cpu_native.SOURCES)


def build(kernel_dir: Path, extra_flags: list[str], label: str):
    """The attention extension built from kernel_dir's sources (cached by their hash)."""
    flags = cpu_native.compile_flags() + extra_flags
    name = cpu_native.sources_module_name("pdserve_attn_ab", kernel_dir, flags)
    return cpu_native.build_or_import(name, [kernel_dir / n for n in SOURCE_NAMES], flags, label)


def round_ms(module, caches, query, meta, out, reps: int) -> float:
    """Median ms of reps calls, each on the next cache copy."""
    scale = HEAD_DIM ** -0.5
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        module.paged_decode(query, caches[i % len(caches)], meta.block_tables, meta.seq_lens,
                            scale, out, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def compare(mods, batch: int, ctx: int, dtype: str, rounds: int, reps: int) -> dict:
    caches, query, meta = make_case(batch, ctx, dtype=KV_DTYPES[dtype])
    outs = [torch.empty_like(query) for _ in mods]
    for m, o in zip(mods, outs):  # warm-up, and the outputs compared
        round_ms(m, caches, query, meta, o, 1)
    ms: list[list[float]] = [[], []]
    for r in range(rounds):  # ab, ba, ab, ...: both see the same drift
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for i in order:
            ms[i].append(round_ms(mods[i], caches, query, meta, outs[i], reps))
    a, b = statistics.median(ms[0]), statistics.median(ms[1])
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * KV_DTYPES[dtype].itemsize
    return dict(batch=batch, ctx=ctx, kv_dtype=dtype, a_ms=round(a, 4), b_ms=round(b, 4),
                a_over_b=round(a / b, 3), b_won=sum(x > y for x, y in zip(*ms)),
                b_gbps=round(kv_bytes / b / 1e6, 1), bit_equal=bool(torch.equal(*outs)),
                a_rounds=[round(x, 3) for x in ms[0]], b_rounds=[round(x, 3) for x in ms[1]])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="baseline cpu_kernels directory")
    ap.add_argument("--b", type=Path, default=cpu_native.KERNEL_DIR)
    ap.add_argument("--b-flags", default="", help="comma-separated extra compile flags for b")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", default="320")
    ap.add_argument("--kv-dtypes", default="float32,bfloat16")
    args = ap.parse_args(argv)
    for n in ("rounds", "reps", "num_threads", "batch"):
        if not 1 <= getattr(args, n) <= 4096:
            raise ValueError(f"--{n.replace('_', '-')} must be in [1, 4096]")
    dtypes = args.kv_dtypes.split(",")
    if not set(dtypes) <= set(KV_DTYPES):
        raise ValueError(f"--kv-dtypes must name some of {', '.join(KV_DTYPES)}")
    contexts = [int(c) for c in args.contexts.split(",")]
    if not all(1 <= c <= 32768 for c in contexts):
        raise ValueError("--contexts must be in [1, 32768]")
    torch.set_num_threads(args.num_threads)
    mods = (build(args.a, [], "attention A"),
            build(args.b, [f for f in args.b_flags.split(",") if f], "attention B"))
    rows = [compare(mods, args.batch, c, dt, args.rounds, args.reps)
            for dt in dtypes for c in contexts]
    cpu = cpu_name()
    print(f"cpu: {cpu}, threads {args.num_threads}")
    for r in rows:
        print(f"B {r['batch']} ctx {r['ctx']} {r['kv_dtype']}: a {r['a_ms']:.3f} ms, "
              f"b {r['b_ms']:.3f} ms ({r['b_gbps']} GB/s), a/b {r['a_over_b']:.3f}, b won "
              f"{r['b_won']}/{args.rounds}, bit-equal {r['bit_equal']}; a {r['a_rounds']} "
              f"b {r['b_rounds']}")
    print(json.dumps({"bench": "attention_ab", "cpu": cpu, "threads": args.num_threads,
                      "b_flags": args.b_flags, "rows": rows}))


if __name__ == "__main__":
    main()
