"""Decode attention of two kernel source trees inside one engine's decode steps, alternated per
step: a decode-attention change's A/B where it runs (bench/attention_ab.py times the kernel
alone, on its own scattered cache).

    mkdir /tmp/base && git archive main common/attention/cpu_kernels | tar -x -C /tmp/base
    python -m pdserve.bench.attention_engine_ab --a /tmp/base/common/attention/cpu_kernels \
        --batch 64 --input-len 300 --steps 60 --kv-cache-dtype bfloat16 --no-prefix-caching

The engine is the one `pdserve serve` runs with the same flags (bench/offline_engine.py). --batch
random prompts of --input-len tokens are prefilled, then every decode step (all --batch rows,
nothing else) runs with attention module a or b in the order ab, ba, ab, ...: both see the same
drift, KV pool and context lengths. Per variant: the median step and the median of the step's
attention calls (the backend's fused step: rotary, KV write and attention, all layers; with
fp32 weights each layer's `fused_forward`, with packed weights at or above fused_rows the
step's `fused_step`). Why in
the engine: on the 2-core VM the whole `bench offline` run moves by +-2% from one process to
the next, more than a 20 ms-per-step attention change shows there. Both modules must give the
same tokens (greedy, the same computation); the outputs are not compared here, the kernel
tests do that. Steps with fewer rows than the packed kernels' fused_rows run the attention
inside the packed stack (bench/kernel_ab.py's A/B), so no attention call is timed there and
this bench refuses. Prints the medians, a / b, the CPU, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from unittest import mock


def parse_args(argv=None) -> argparse.Namespace:
    from pdserve.bench.offline_engine import add_served_engine_args
    from pdserve.common.engine.cli import add_weights_arg

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="baseline cpu_kernels directory")
    ap.add_argument("--b", type=Path, default=None,
                    help="cpu_kernels directory of variant b (default: this checkout's build)")
    ap.add_argument("--model", default="smollm2")
    add_weights_arg(ap)
    add_served_engine_args(ap)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=300)
    ap.add_argument("--steps", type=int, default=60, help="decode steps (half per variant)")
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args(argv)
    for name, lo, hi in (("batch", 1, 1024), ("input_len", 1, 32768), ("steps", 4, 4096),
                         ("num_threads", 1, 256)):
        if not lo <= getattr(args, name) <= hi:
            raise ValueError(f"--{name.replace('_', '-')} must be in [{lo}, {hi}]")
    return args


def _modules(args):
    from pdserve.bench.attention_ab import build
    from pdserve.common.attention.cpu_native import load_cpu_kernels

    b = load_cpu_kernels() if args.b is None else build(args.b, [], "attention B")
    if b is None:
        raise SystemExit("native kernels unavailable (PDSERVE_NO_NATIVE=1 or build failed)")
    return {"a": build(args.a, [], "attention A"), "b": b}


def _engine(args):
    from pdserve.bench.offline_engine import served_engine_config
    from pdserve.common.engine.llm import LLM
    from pdserve.common.sampling_params import SamplingParams

    core = LLM(served_engine_config(args, args.weights, args.kv_cache_dtype, args.batch,
                                    args.input_len + args.steps + 4)).engine
    if args.batch > core.config.scheduler.max_num_seqs:
        raise ValueError(f"--batch {args.batch} exceeds max_num_seqs "
                         f"{core.config.scheduler.max_num_seqs}: raise --max-num-seqs")
    rng, vocab = random.Random(0), core.model_config.vocab_size
    params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        core.add_request(f"ab-{i}", [rng.randrange(vocab) for _ in range(args.input_len)], params)
    return core


def run(args, core, mods) -> dict[str, dict[str, list[float]]]:
    """Step and attention seconds per variant, decode steps of all --batch rows only."""
    from pdserve.common.attention import torch_backend

    current = {"module": mods["b"], "attention_s": 0.0}
    native_module = torch_backend._native_module
    backend = torch_backend.TorchAttentionBackend
    fused_step, fused_forward = backend.fused_step, backend.fused_forward

    def pick(query, kv_cache, meta):  # the variant's module wherever the native one applies
        return None if native_module(query, kv_cache, meta) is None else current["module"]

    def timed_step(self, meta, kv_cache, cos, sin):
        attend = fused_step(self, meta, kv_cache, cos, sin)
        if attend is None:
            return None

        def timed(*a):
            t0 = time.perf_counter()
            out = attend(*a)
            current["attention_s"] += time.perf_counter() - t0
            return out
        return timed

    def timed_forward(self, *a, **kw):  # the module path's per-layer fused step (fp32 weights)
        t0 = time.perf_counter()
        out = fused_forward(self, *a, **kw)
        current["attention_s"] += time.perf_counter() - t0
        return out

    runs = {n: {"step_s": [], "attention_s": []} for n in mods}
    with mock.patch.object(torch_backend, "_native_module", pick), \
            mock.patch.object(backend, "fused_step", timed_step), \
            mock.patch.object(backend, "fused_forward", timed_forward):
        k = 0
        while core.has_unfinished_requests():
            name = ("ab" if (k // 2) % 2 == 0 else "ba")[k % 2]
            current["module"], current["attention_s"] = mods[name], 0.0
            t0 = time.perf_counter()
            core.step()
            dt = time.perf_counter() - t0
            if (core.profile.last_step_tokens == args.batch
                    and len(core.scheduler.running) == args.batch):
                runs[name]["step_s"].append(dt)
                runs[name]["attention_s"].append(current["attention_s"])
                k += 1
    return runs


def main(argv=None) -> int:
    import torch

    from pdserve.bench.offline import cpu_name

    args = parse_args(argv)
    torch.set_num_threads(args.num_threads)
    mods = _modules(args)
    runs = run(args, _engine(args), mods)
    med = {n: {k: statistics.median(v) * 1e3 for k, v in r.items()} for n, r in runs.items()}
    if min(med["a"]["attention_s"], med["b"]["attention_s"]) <= 0:
        raise SystemExit(f"no attention call was timed at batch {args.batch}: below the packed "
                         "kernels' fused_rows the packed stack attends (use bench/kernel_ab.py)")
    res = {"bench": "attention_engine_ab", "cpu": cpu_name(), "batch": args.batch,
           "input_len": args.input_len, "kv_cache_dtype": args.kv_cache_dtype,
           "weights": args.weights, "num_threads": args.num_threads,
           "steps_per_variant": {n: len(r["step_s"]) for n, r in runs.items()},
           "step_ms": {n: med[n]["step_s"] for n in med},
           "attention_ms": {n: med[n]["attention_s"] for n in med},
           "step_a_over_b": med["a"]["step_s"] / med["b"]["step_s"],
           "attention_a_over_b": med["a"]["attention_s"] / med["b"]["attention_s"]}
    for n in ("a", "b"):
        print(f"{n}: decode step {med[n]['step_s']:.1f} ms, attention {med[n]['attention_s']:.1f} "
              f"ms a step (median of {len(runs[n]['step_s'])} steps)")
    print(f"a / b: step {res['step_a_over_b']:.3f}, attention {res['attention_a_over_b']:.3f} "
          f"({res['cpu']}, {args.num_threads} threads, batch {args.batch})")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
