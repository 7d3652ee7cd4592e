"""Batch-1 decode step with a stage's packed layers in one native call (packed_stack.py) vs one
call per layer (packed_layer.py), in one process, the two interleaved per round:

    python -m pdserve.bench.packed_stack_ab --rounds 5 --num-threads 2

Each round runs one --input-len prompt for --output-len greedy tokens per variant and takes the
median decode step; prints the medians over rounds, the ratio per-layer / stack, the CPU, then
one JSON line. The engine is the one `pdserve serve` runs with these flags (packed weights by
default for the GGUF).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def _median_step_ms(core, rng, vocab: int, input_len: int, output_len: int) -> float:
    from pdserve.common.sampling_params import SamplingParams

    core.add_request(f"ab-{rng.random()}", [rng.randrange(vocab) for _ in range(input_len)],
                     SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    times = []
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3  # the first step is the prefill


def parse_step_ab_args(ap: argparse.ArgumentParser, argv, rounds: int) -> argparse.Namespace:
    """The engine and workload flags of a batch-1 step A/B (this module, kernel_ab.py), parsed
    and bounded; torch's thread count set from them."""
    from pdserve.bench.offline_engine import add_served_engine_args
    from pdserve.common.engine.cli import add_weights_arg

    ap.add_argument("--model", default="smollm2")
    add_weights_arg(ap)
    add_served_engine_args(ap)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not (1 <= args.rounds <= 200 and 2 <= args.output_len <= 4096
            and 1 <= args.input_len <= 8192 and 1 <= args.num_threads <= 256):
        raise ValueError("--rounds must be 1..200, --output-len 2..4096, --input-len 1..8192 "
                         "and --num-threads 1..256")
    import torch

    torch.set_num_threads(args.num_threads)
    return args


def batch1_engine(args):
    """The engine `pdserve serve` runs with these flags, sized for one request."""
    from pdserve.bench.offline_engine import served_engine_config
    from pdserve.common.engine.llm import LLM

    return LLM(served_engine_config(args, args.weights, args.kv_cache_dtype, 1,
                                    args.input_len + args.output_len + 2)).engine


def main(argv=None) -> int:
    from pdserve.bench.offline import cpu_name

    args = parse_step_ab_args(argparse.ArgumentParser(description=__doc__), argv, rounds=5)
    core = batch1_engine(args)
    model, rng, vocab = core.model, random.Random(0), core.model_config.vocab_size
    stack = model._packed_stack
    if stack is None:
        raise ValueError("this engine has no packed stack (fp32 weights or no native build)")
    _median_step_ms(core, rng, vocab, args.input_len, 16)  # warm-up
    runs: dict[str, list[float]] = {"stack": [], "per_layer": []}
    for _ in range(args.rounds):
        for name, value in (("stack", stack), ("per_layer", None)):
            model._packed_stack = value
            runs[name].append(_median_step_ms(core, rng, vocab, args.input_len, args.output_len))
    model._packed_stack = stack
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = med["per_layer"] / med["stack"]
    print(f"batch-1 decode step: stack {med['stack']:.3f} ms, one call per layer "
          f"{med['per_layer']:.3f} ms, per_layer / stack {ratio:.3f}  ({cpu_name()}, "
          f"{args.num_threads} threads)")
    print(json.dumps({"step_ms": med, "runs": runs, "per_layer_vs_stack": ratio,
                      "cpu": cpu_name(), "num_threads": args.num_threads}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
