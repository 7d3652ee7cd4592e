"""Batch-1 decode step with the packed-weight kernels of two checkouts, in one process, the two
alternated per round: a kernel change's A/B.

    git worktree add /tmp/base HEAD~1
    python -m pdserve.bench.kernel_ab --a /tmp/base --rounds 20 --num-threads 2

Why one process: on a shared 2-core VM one process's batch-1 step moved by up to a tenth from
the next process's with the same kernels (3.5 to 4.2 ms within an hour on the Zen 5), more than
most kernel changes gain; in one process, alternating rounds (ABAB, then BABA), both variants
see the same drift. --a and --b are repository roots (--b defaults to this checkout); each
one's common/models/quant/cpu_kernels (and the attention headers it includes) is built into its
own module, cached by source hash like the engine's. The engine is this checkout's; the
packed kernels of the decoder stack and of the packed LM head are swapped (quant/gemm.py's
kernel lookup is patched for the round, so a change to the M = 1 kernels that the LM head runs
is timed too; the embedding's row lookup stays on this checkout's). Each round
runs one --input-len prompt for --output-len greedy tokens per variant and takes the median
decode step; prints the rounds, the medians, the ratio a / b (> 1: b is faster), how many
rounds b won, the CPU, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from unittest import mock


def main(argv=None) -> int:
    from pdserve.bench.offline import cpu_name
    from pdserve.bench.packed_stack_ab import _median_step_ms, batch1_engine, parse_step_ab_args
    from pdserve.common.models.quant import gemm
    from pdserve.common.models.quant.cpu_native import build_checkout_kernels

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--a", type=Path, required=True, help="repository root of variant a")
    ap.add_argument("--b", type=Path, default=Path(__file__).resolve().parents[1],
                    help="repository root of variant b (default: this checkout)")
    args = parse_step_ab_args(ap, argv, rounds=20)
    kernels = {"a": build_checkout_kernels(args.a), "b": build_checkout_kernels(args.b)}
    core = batch1_engine(args)
    model, rng, vocab = core.model, random.Random(0), core.model_config.vocab_size
    if model._packed_stack is None:
        raise ValueError("this engine has no packed stack (fp32 weights or no native build)")
    runs: dict[str, list[float]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
            model._packed_gemm = kernels[name]
            with mock.patch.object(gemm, "load_packed_kernels", lambda k=kernels[name]: k):
                _median_step_ms(core, rng, vocab, args.input_len, 8)  # this variant's caches warm
                runs[name].append(_median_step_ms(core, rng, vocab, args.input_len,
                                                  args.output_len))
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = med["a"] / med["b"]
    b_won = sum(b < a for a, b in zip(runs["a"], runs["b"]))
    for k in ("a", "b"):
        print(f"{k}: " + " ".join(f"{x:.3f}" for x in runs[k]))
    print(f"batch-1 decode step: a {med['a']:.3f} ms, b {med['b']:.3f} ms, a / b {ratio:.3f}, "
          f"b faster in {b_won} of {args.rounds} rounds  ({cpu_name()}, {args.num_threads} "
          "threads)")
    print(json.dumps({"step_ms": med, "runs": runs, "a_vs_b": ratio, "b_faster_rounds": b_won,
                      "a": str(args.a), "b": str(args.b), "cpu": cpu_name(),
                      "num_threads": args.num_threads}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
