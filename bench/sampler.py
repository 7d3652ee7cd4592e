"""`pdserve bench sampler`: the sampler's time per decode step, the engine's batched inverse-CDF
sampler against the sampler it replaced (a full-vocabulary exponential noise row per request,
drawn one request at a time from each request's torch.Generator), in one run; and the engine's
sampler on its torch path alone (`torch ms`: before the native kernel) against the same sampler
with the native kernel (`new ms`, sample_native; the JSON's `native` names its build, null when
it did not load, and then both columns time the torch path).

Logits are real: SmolLM2's decode-step logits for --rows random prompts (recorded from the
engine), or `--logits synthetic` (normal, --scale) where the model is absent. Each case (plain
temperature, top-k, top-p, min-p, all three, greedy) is timed --reps times per sampler,
interleaved; medians are printed, with the ratio old / new. The last line is one JSON object.

    python -m pdserve.bench.sampler [--rows 64] [--num-threads 2] [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.common.engine import sample_native
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampler import Sampler
from pdserve.bench.offline import cpu_name
from pdserve.bench.sampler_args import sampler_args
from pdserve.common.sampling_params import SamplingParams


CASES = {
    "temperature=1": dict(temperature=1.0),
    "top_k=50": dict(temperature=0.8, top_k=50),
    "top_p=0.95": dict(temperature=0.8, top_p=0.95),
    "min_p=0.05": dict(temperature=0.8, min_p=0.05),
    "top_k+top_p+min_p": dict(temperature=0.8, top_k=100, top_p=0.9, min_p=0.02),
    "greedy": dict(temperature=0.0),
}


def old_sample(logits: torch.Tensor, reqs: list[Request], gens: list[torch.Generator]):
    """The replaced sampler's random path (sampler.py before this change): temperature, the
    sort-based top-k / top-p / min-p filter, then argmax of p / Exp(1) with one noise row per
    request drawn from that request's generator."""
    params = [r.params for r in reqs]
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    probs = _old_filter(logits / temps, params).softmax(dim=-1)
    noise = torch.empty_like(probs)
    for j, g in enumerate(gens):
        noise[j].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def _old_filter(logits, params):
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        v = logits.shape[-1]
        k = torch.tensor([k if k > 0 else v for k in top_ks]).clamp(max=v)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_ps = torch.tensor([p.top_p for p in params])
    if (top_ps < 1).any():
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = (cum - sorted_logits.softmax(-1)) >= top_ps.unsqueeze(1)
        logits = logits.scatter(1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    min_ps = torch.tensor([p.min_p for p in params])
    if (min_ps > 0).any():
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * min_ps.unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def model_logits(rows: int):
    """SmolLM2's logits at a decode step of `rows` random 32-token prompts [rows, V], and its
    tokenizer."""
    from pdserve.common.config import CacheConfig, EngineConfig
    from pdserve.common.engine.llm import LLM

    llm = LLM(EngineConfig(model="smollm2", num_threads=torch.get_num_threads(),
                           cache=CacheConfig(num_blocks=rows * 4 + 16)))
    seen = []
    sampler = llm.engine.sampler  # EngineCore samples the runner's logits

    class Recording:  # the engine's sampler, keeping each step's logits
        check = sampler.check

        def __call__(self, logits, reqs):
            seen.append(logits.clone())
            return sampler(logits, reqs)

    llm.engine.sampler = Recording()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (32,), generator=gen).tolist() for _ in range(rows)]
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=1.0, seed=0, ignore_eos=True))
    return next(x for x in reversed(seen) if x.shape[0] == rows), llm.tokenizer


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def run(args) -> int:
    torch.set_num_threads(args.num_threads)
    tokenizer = None
    if args.logits == "smollm2":
        logits, tokenizer = model_logits(args.rows)
    else:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(args.rows, args.vocab, generator=gen) * args.scale
    rows, vocab = logits.shape
    sampler = Sampler(vocab, tokenizer)
    reference = Sampler(vocab, tokenizer, use_native=False)
    native = sample_native.kernels_for(logits)
    results = {}
    print(f"{'case':<20}{'old ms':>10}{'torch ms':>10}{'new ms':>10}{'old/new':>10}"
          f"{'torch/new':>10}")
    for name, kw in CASES.items():
        reqs = [Request(f"r{i}", [1], SamplingParams(seed=i, max_tokens=8, **kw), 8)
                for i in range(rows)]
        gens = [torch.Generator().manual_seed(i) for i in range(rows)]
        greedy = reqs[0].params.greedy
        old_fn = (lambda: logits.argmax(dim=-1)) if greedy else \
            (lambda: old_sample(logits, reqs, gens))
        new_fn = lambda: sampler(logits, reqs)  # noqa: E731
        torch_fn = lambda: reference(logits, reqs)  # noqa: E731
        old_fn(), torch_fn(), new_fn()  # warm-up
        old, ref, new = [], [], []
        for _ in range(args.reps):  # interleaved, so drift hits all alike
            old.append(_median_ms(old_fn, 1))
            ref.append(_median_ms(torch_fn, 1))
            new.append(_median_ms(new_fn, 1))
        o, t, n = statistics.median(old), statistics.median(ref), statistics.median(new)
        results[name] = {"old_ms": o, "torch_ms": t, "new_ms": n, "ratio": o / n,
                         "native_speedup": t / n}
        print(f"{name:<20}{o:>10.2f}{t:>10.2f}{n:>10.2f}{o / n:>10.1f}{t / n:>10.1f}")
    if tokenizer is not None:
        results["json_schema"] = _structured_case(sampler, logits, tokenizer, args.reps)
    line = {"bench": "sampler", "rows": rows, "vocab": vocab, "logits": args.logits,
            "num_threads": args.num_threads, "reps": args.reps, "cpu": cpu_name(),
            "native": None if native is None else native.simd,
            "cases": results}
    print(json.dumps(line))
    return 0


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "ccc"],
       "address": {"city": "London", "zip": "12345"}}


def _structured_case(sampler, logits, tokenizer, reps: int) -> dict:
    """Every row constrained by SCHEMA at a different point of a valid document (row i has
    generated its first i % len tokens): the step's grammar work (mask fill per row, bitmask
    applied) on top of temperature-1 sampling, against the same rows unconstrained."""
    from pdserve.common.structured_output import StructuredKind, StructuredOutput

    so = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
    doc = tokenizer.encode(json.dumps(DOC))
    reqs, plain = [], []
    for i in range(logits.shape[0]):
        for kw, out in ((dict(structured_output=so), reqs), ({}, plain)):
            r = Request(f"s{i}", [1], SamplingParams(seed=i, max_tokens=64, **kw), 64)
            for t in doc[:i % len(doc)]:
                r.append_token(t)
            out.append(r)
    sampler(logits, reqs)  # warm-up: compiles, replays each row's tokens once
    base, con = [], []
    for _ in range(reps):
        base.append(_median_ms(lambda: sampler(logits, plain), 1))
        con.append(_median_ms(lambda: sampler(logits, reqs), 1))
    b, c = statistics.median(base), statistics.median(con)
    print(f"{'json_schema':<20}{b:>10.2f}{'':>10}{c:>10.2f}{b / c:>10.1f}   (unconstrained vs "
          f"{len(reqs)} constrained rows)")
    return {"old_ms": b, "new_ms": c, "ratio": b / c, "note": "unconstrained vs constrained"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.sampler")
    sampler_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
