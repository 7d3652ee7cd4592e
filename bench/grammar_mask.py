"""Grammar engines' token-mask time at SmolLM2's vocabulary (49,152): xgrammar (the one the
engine uses) against llguidance (measured when installed: `pip install llguidance`).

One nested JSON schema; a valid document is fed token by token and the next-token bitmask is
filled before each token (and once at the end). Prints per engine: tokenizer-table build,
compile time, mask fill median / p99 / max, then one JSON line.

    python -m pdserve.bench.grammar_mask
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from pdserve.bench.sampler import DOC, SCHEMA


def _stats(times: list[float]) -> dict:
    times = sorted(times)
    return {"mask_us_median": statistics.median(times) * 1e6,
            "mask_us_p99": times[int(0.99 * (len(times) - 1))] * 1e6,
            "mask_us_max": times[-1] * 1e6}


def run_xgrammar(hf, vocab: int, eos: list[int], ids: list[int]) -> dict:
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for tok in ids + [None]:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t)
        if tok is not None and not matcher.accept_token(tok):
            raise RuntimeError(f"xgrammar refused token {tok}")
    return {"tokenizer_s": t1 - t0, "compile_ms": (t2 - t1) * 1e3, **_stats(times)}


def run_llguidance(hf, vocab: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    t1 = time.perf_counter()
    matcher = llguidance.LLMatcher(
        tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    mask = lt.allocate_token_bitmask(1, vocab)
    times = []
    for t_id in ids + [None]:
        t = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - t)
        if t_id is not None and not matcher.consume_token(t_id):
            raise RuntimeError(f"llguidance refused token {t_id}: {matcher.get_error()}")
    return {"tokenizer_s": t1 - t0, "compile_ms": (t2 - t1) * 1e3, **_stats(times)}


def main() -> int:
    from transformers import PreTrainedTokenizerFast

    from pdserve.common.models.registry import _packaged_smollm2
    from pdserve.common.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_gguf(_packaged_smollm2())
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    vocab, ids = tokenizer.vocab_size, tokenizer.encode(json.dumps(DOC))
    res = {"bench": "grammar_mask", "vocab": vocab, "doc_tokens": len(ids),
           "xgrammar": run_xgrammar(hf, vocab, list(tokenizer.eos_token_ids), ids)}
    try:
        res["llguidance"] = run_llguidance(hf, vocab, ids)
    except ImportError:
        res["llguidance"] = None
    for name in ("xgrammar", "llguidance"):
        r = res[name]
        if r is None:
            print(f"{name:<12} not installed")
            continue
        print(f"{name:<12} tokenizer {r['tokenizer_s']:.2f} s  compile {r['compile_ms']:.1f} ms"
              f"  mask median {r['mask_us_median']:.1f} us  p99 {r['mask_us_p99']:.1f} us"
              f"  max {r['mask_us_max']:.1f} us")
    if res["llguidance"]:
        res["ratio_median_llguidance_over_xgrammar"] = (
            res["llguidance"]["mask_us_median"] / res["xgrammar"]["mask_us_median"])
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
