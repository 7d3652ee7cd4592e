"""Offline decode step time at given batch sizes (the peer of served ITL p50):

    python -m pdserve.bench.offline_step --batch 8 16 --num-threads 2

For each batch size B: B random prompts of --input-len tokens are prefilled, then
--decode-steps steps that are decodes only (B rows each) are timed one by one; prints the
median per B, then one JSON line {"decode_step_ms": {B: ms}, "cpu": ...}. The engine is the one
`pdserve serve` runs with the same flags (bench/offline_engine.py; --weights too: give
`--weights fp32` against a `--weights fp32` stack).

`--context-spread N` gives the B prompts lengths spread evenly over [--input-len,
--input-len + N) instead of all --input-len: a served batch at rate 2 mixes requests from their
first generated token to their last (prompts of 256 plus 0-127 generated: contexts 256-383,
`--input-len 256 --context-spread 128`), while the default batch decodes at one context,
--input-len to --input-len + --decode-steps. The same work per step as the served batch, not
a slower one: the KV each row attends over is the served rows'.

`--beside-load BUSY_MS/PERIOD_MS` runs, in a separate process for the whole measurement, one
thread that spins BUSY_MS out of every PERIOD_MS (e.g. 3/15: a fifth of a core): what a router,
a client and an event loop do beside a served engine's forward on the same cores, so a served
step's slowdown from that foreign CPU can be reproduced offline.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

# the --beside-load process: spin busy seconds out of every period seconds, until killed
_SPIN = ("import sys,time\nb,p=float(sys.argv[1]),float(sys.argv[2])\nwhile True:\n"
         " t=time.perf_counter()\n while time.perf_counter()-t<b: pass\n"
         " time.sleep(max(0.0,p-(time.perf_counter()-t)))\n")


def parse_beside_load(text: str) -> tuple[float, float]:
    """'BUSY_MS/PERIOD_MS' -> (busy_s, period_s), with 0 < busy <= period."""
    try:
        busy, period = (float(x) / 1e3 for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--beside-load wants BUSY_MS/PERIOD_MS, got {text!r}") from None
    if not 0 < busy <= period:
        raise ValueError(f"--beside-load needs 0 < BUSY_MS <= PERIOD_MS, got {text!r}")
    return busy, period


def prompt_len(input_len: int, spread: int, i: int, batch: int) -> int:
    """The i-th of `batch` prompts' length: evenly over [input_len, input_len + spread)."""
    return input_len + spread * i // batch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    from pdserve.bench.offline_engine import add_served_engine_args, served_engine_config
    from pdserve.common.engine.cli import add_weights_arg

    ap.add_argument("--model", default="smollm2")
    add_weights_arg(ap)  # --weights, --dtype, --kv-cache-dtype: the served engine's defaults
    add_served_engine_args(ap)  # the served engine's settings (bench/offline_engine.py)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--context-spread", type=int, default=0, metavar="N",
                    help="prompt lengths spread over [input-len, input-len + N) (see above)")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--beside-load", default="", metavar="BUSY_MS/PERIOD_MS",
                    help="a foreign CPU load in another process while timing (see above)")
    args = ap.parse_args(argv)
    load = parse_beside_load(args.beside_load) if args.beside_load else None
    if args.context_spread < 0:
        raise ValueError(f"--context-spread must be >= 0, got {args.context_spread}")
    import torch

    torch.set_num_threads(args.num_threads)
    from pdserve.bench.offline import cpu_name
    from pdserve.common.engine.llm import LLM

    # the engine a served instance runs with these flags, its KV sized to the largest batch
    llm = LLM(served_engine_config(args, args.weights, args.kv_cache_dtype, max(args.batch),
                                   args.input_len + args.context_spread + args.decode_steps + 2))
    core, rng = llm.engine, random.Random(0)
    if max(args.batch) > llm.engine.config.scheduler.max_num_seqs:
        raise ValueError(f"--batch {max(args.batch)} exceeds max_num_seqs "
                         f"{llm.engine.config.scheduler.max_num_seqs}: raise --max-num-seqs")
    vocab = core.model_config.vocab_size
    beside = None if load is None else subprocess.Popen(
        [sys.executable, "-c", _SPIN, str(load[0]), str(load[1])])
    try:
        res = _time_batches(args, core, rng, vocab)
    finally:
        if beside is not None:
            beside.kill()
            beside.wait()
    print(json.dumps({"decode_step_ms": res, "temperature": args.temperature,
                      "input_len": args.input_len, "context_spread": args.context_spread,
                      "num_threads": args.num_threads, "beside_load": args.beside_load,
                      "cpu": cpu_name()}), flush=True)
    return 0


def _time_batches(args, core, rng, vocab) -> dict:
    from pdserve.common.sampling_params import SamplingParams

    res = {}
    for b in args.batch:
        params = SamplingParams(max_tokens=args.decode_steps + 2, temperature=args.temperature,
                                ignore_eos=True)
        for i in range(b):
            n = prompt_len(args.input_len, args.context_spread, i, b)
            core.add_request(f"b{b}-{i}", [rng.randrange(vocab) for _ in range(n)], params)
        times = []
        while core.has_unfinished_requests():
            t0 = time.perf_counter()
            core.step()
            dt = time.perf_counter() - t0
            if core.profile.last_step_tokens == b and len(core.scheduler.running) == b:
                times.append(dt)
        res[b] = statistics.median(times) * 1e3
        print(f"batch {b}: decode step {res[b]:.1f} ms (median of {len(times)})", flush=True)
    return res


if __name__ == "__main__":
    raise SystemExit(main())
