"""Served step times one by one, split into decode-only steps and steps with prompt tokens.

    python -m pdserve.bench.serve_step_trace --engine HOST:PORT --duration 40 \
        [--after-first-step 300] [--delay S] [--poll-ms 15] [--records-out PATH]

polls the engine's cumulative StepProfile (GetLoad) every --poll-ms; when exactly one step
ran between two polls, that step's record is its delta: tokens computed, rows sampled and the
engine thread's wall time (schedule + forward + sample + update + publish). A step is
decode-only when it computed as many tokens as it sampled (every prompt chunk computes more
tokens than it samples, but for a 1-token final chunk). Polls that saw 0 or several steps give
no record (the record count says how many were caught).

What it prints answers "is ITL p50 a decode step, and is a served decode step as fast as an
offline one": the share of steps with prompt tokens, medians of each kind, the engine-side
ITL distribution (every step's time weighted by the tokens it gave: each sampled row is one
inter-token gap of one stream), the token-weighted median batch (the batch an ITL p50 sees:
not the step-weighted mean), and the decode-only step medians per batch-size bin, to read
beside `python -m pdserve.bench.offline_step --batch ...`. Then one JSON line.

Polling costs the engine's event loop one GetLoad per poll, and more than that: at 20 ms polls
on a 2-core host the engine's own decode-only steps went from 1.06x to 1.19x the offline step
in one hold (docs/served-performance.md, "The engine's own step at rate 2"). To time the step,
have the engine log it (`PDSERVE_STEP_LOG`, `bench/step_log_split.py`; `STEP_LOG=1 bash
bench/serve_rate2.sh`); this trace is for what a GetLoad reader sees.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass

ENGINE_PHASES = ("schedule", "forward", "sample", "update", "publish")


@dataclass(frozen=True)
class StepRecord:
    tokens: int  # tokens computed (prompt chunk tokens + decodes)
    sampled: int  # rows sampled (one per stream that got a token)
    wall_ms: float  # the engine thread's time in the step

    @property
    def decode_only(self) -> bool:
        return self.tokens == self.sampled


def step_record(before: dict, after: dict) -> StepRecord | None:
    """The one step between two StepProfile snapshots; None unless exactly one step ran."""
    if after["num_steps"] - before["num_steps"] != 1:
        return None
    ns = sum(after[f"{p}_ns"] - before[f"{p}_ns"] for p in ENGINE_PHASES)
    return StepRecord(after["num_tokens"] - before["num_tokens"],
                      after["num_sampled"] - before["num_sampled"], ns / 1e6)


def weighted_median(pairs: list[tuple[float, int]]) -> float:
    """Median of values each repeated `weight` times ((value, weight) pairs, weights >= 0)."""
    total = sum(w for _, w in pairs)
    if total <= 0:
        raise ValueError("no weight to take a median of")
    acc = 0
    for v, w in sorted(pairs):
        acc += w
        if 2 * acc >= total:
            return v
    raise AssertionError("unreachable")


def batch_bin(batch: int, width: int) -> int:
    """The bin a decode-only step's batch falls in: its lower edge (multiples of width)."""
    return batch // width * width


def summarize(records: list[StepRecord], bin_width: int = 8) -> dict:
    """The split the module docstring describes (plain numbers, for printing and tests)."""
    if not records:
        raise ValueError("no single step was caught: poll faster or run a load")
    dec = [r for r in records if r.decode_only]
    pre = [r for r in records if not r.decode_only]
    sampled = [(r.wall_ms, r.sampled) for r in records if r.sampled]
    out = {
        "records": len(records),
        "decode_only_steps": len(dec),
        "prompt_steps": len(pre),
        "prompt_step_share": round(len(pre) / len(records), 4),
        "token_share_of_prompt_steps": round(
            sum(r.sampled for r in pre) / max(1, sum(r.sampled for r in records)), 4),
        "decode_step_p50_ms": round(statistics.median(r.wall_ms for r in dec), 2) if dec else None,
        "prompt_step_p50_ms": round(statistics.median(r.wall_ms for r in pre), 2) if pre else None,
        "prompt_tokens_per_prompt_step": round(
            statistics.mean(r.tokens - r.sampled for r in pre), 1) if pre else None,
        "engine_itl_p50_ms": round(weighted_median(sampled), 2) if sampled else None,
        "mean_batch": round(statistics.mean(r.sampled for r in records), 2),
        "token_weighted_median_batch": weighted_median([(r.sampled, r.sampled)
                                                        for r in records if r.sampled])
        if sampled else None,
    }
    bins: dict[int, list[float]] = {}
    for r in dec:
        bins.setdefault(batch_bin(r.sampled, bin_width), []).append(r.wall_ms)
    out["decode_step_ms_by_batch"] = {
        f"{lo}-{lo + bin_width - 1}": {"steps": len(v), "p50_ms": round(statistics.median(v), 2)}
        for lo, v in sorted(bins.items())}
    return out


def collect(snapshot, duration_s: float, poll_s: float) -> list[StepRecord]:
    """Poll `snapshot()` (a StepProfile dict) for duration_s; the single-step records."""
    records = []
    prev = snapshot()
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        time.sleep(poll_s)
        cur = snapshot()
        rec = step_record(prev, cur)
        if rec is not None:
            records.append(rec)
        prev = cur
    return records


def main(argv=None) -> int:
    from pdserve.bench import serve_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="the engine's gRPC host:port")
    ap.add_argument("--tls-dir", default="")
    ap.add_argument("--engine-role", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--after-first-step", type=float, default=0.0, metavar="MAX_S")
    ap.add_argument("--poll-ms", type=float, default=15.0)
    ap.add_argument("--bin-width", type=int, default=8)
    ap.add_argument("--records-out", default="", metavar="PATH",
                    help="also write every caught step as a JSON line (bench/itl_peer.py "
                         "reads it beside the run as step_trace.jsonl)")
    args = ap.parse_args(argv)
    if args.after_first_step > 0:
        serve_profile.wait_for_a_step(args, time.monotonic() + args.after_first_step)
    time.sleep(args.delay)
    snap = serve_profile.snapshot_fn(args.engine, args.tls_dir, args.engine_role)
    records = collect(snap, args.duration, args.poll_ms / 1e3)
    if args.records_out:
        with open(args.records_out, "w") as f:
            f.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in records)
    s = summarize(records, args.bin_width)
    print(f"{s['records']} single steps caught: {s['decode_only_steps']} decode-only "
          f"(p50 {s['decode_step_p50_ms']} ms), {s['prompt_steps']} with prompt tokens "
          f"(p50 {s['prompt_step_p50_ms']} ms, {s['prompt_tokens_per_prompt_step']} prompt "
          f"tokens each; {s['token_share_of_prompt_steps']:.0%} of the tokens rode in them)")
    print(f"engine-side ITL p50 {s['engine_itl_p50_ms']} ms; mean batch {s['mean_batch']}, "
          f"token-weighted median batch {s['token_weighted_median_batch']}")
    for b, v in s["decode_step_ms_by_batch"].items():
        print(f"  decode-only, batch {b:>7}: {v['p50_ms']:8.2f} ms (p50 of {v['steps']})")
    print(json.dumps({"bench": "serve_step_trace", **s}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
