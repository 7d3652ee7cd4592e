"""ITL p50 served vs the offline decode step at the batch the served tokens rode.

Issue 19 compares ITL p50 at rate 2 with the offline decode step "at the same batch size".
The batch a served run decodes at depends on its arrivals (the same rate gave a median of 12
in one seed's run and 30 in another's), so a fixed batch is the wrong peer. From the bench's
per-request records: each token after a request's first arrives while some requests are
between their first token and their end; the median of that count over all such tokens is the
batch the median token rode (the token-weighted batch). The offline step there is linearly
interpolated between the batches `offline_step` timed.

    python -m pdserve.bench.itl_peer OFFLINE_STEP_JSON [...] RUN_DIR [RUN_DIR ...]
    python bench/itl_peer.py ...  (stdlib only: it runs beside any checkout under test)

RUN_DIR holds one `pdserve bench serve` run (serve.json, as --out-dir writes it) and, when
`bench/serve_step_trace.py --records-out RUN_DIR/step_trace.jsonl` ran beside it, the served
engine's own decode-only steps: each over the offline step at its batch, so a slow step is
told apart from a slow path after the step. Several OFFLINE_STEP_JSON files (the arguments
that are files; the run folders are not): the offline step at each batch is their median.
Prints each run, then one JSON line.
"""

from __future__ import annotations

import bisect
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Mapping, Sequence


def token_weighted_batch(per_request: Sequence[Mapping]) -> float:
    """The median, over every token after a request's first, of how many requests were then
    decoding (between their first token and their end); 0 when no request has a gap."""
    spans, arrivals = [], []
    for r in per_request:
        if not r.get("ok") or r.get("ttft_s") is None:
            continue
        first = r["start_s"] + r["ttft_s"]
        spans.append((first, r["start_s"] + r["e2e_s"]))
        t = first
        for gap in r["itl_s"]:
            t += gap
            arrivals.append(t)
    if not arrivals:
        return 0.0
    starts = sorted(a for a, _ in spans)
    ends = sorted(b for _, b in spans)
    # decoding at t: started at or before t, not ended before t
    counts = [bisect.bisect_right(starts, t) - bisect.bisect_left(ends, t) for t in arrivals]
    return float(statistics.median(counts))


def step_at(steps_ms: Mapping[int, float], batch: float) -> float:
    """The offline step at `batch`, linear between the timed batches (clamped at the ends)."""
    if not steps_ms:
        raise ValueError("no offline step timed")
    xs = sorted(steps_ms)
    if batch <= xs[0]:
        return steps_ms[xs[0]]
    if batch >= xs[-1]:
        return steps_ms[xs[-1]]
    i = bisect.bisect_right(xs, batch)
    lo, hi = xs[i - 1], xs[i]
    return steps_ms[lo] + (steps_ms[hi] - steps_ms[lo]) * (batch - lo) / (hi - lo)


def run_row(run: Mapping, steps_ms: Mapping[int, float]) -> dict:
    """One run's ITL p50, its token-weighted batch and the ratio to the offline step there."""
    batch = token_weighted_batch(run["per_request"])
    step = step_at(steps_ms, batch)
    itl_ms = run["itl_s"]["p50"] * 1e3
    return {"itl_p50_ms": itl_ms, "batch": batch, "offline_step_ms": step,
            "ratio": itl_ms / step, "ttft_p50_s": run["ttft_s"]["p50"],
            "output_tok_s": run["output_throughput"], "failed": run["failed"]}


def engine_step_ratio(records: Sequence[Mapping], steps_ms: Mapping[int, float]) -> dict:
    """The served engine's own decode-only steps (serve_step_trace --records-out lines: tokens,
    sampled, wall_ms) over the offline step at each one's batch: medians of the ratio and of
    the batch, and the fastest tenth's ratio. Empty when no decode-only step was caught."""
    ratios, batches = [], []
    for r in records:
        if r["sampled"] and r["tokens"] == r["sampled"]:
            ratios.append(r["wall_ms"] / step_at(steps_ms, r["sampled"]))
            batches.append(r["sampled"])
    if not ratios:
        return {}
    ratios.sort()
    return {"engine_decode_steps": len(ratios),
            "engine_decode_ratio_p50": statistics.median(ratios),
            "engine_decode_ratio_p10": ratios[len(ratios) // 10],
            "engine_decode_batch_p50": statistics.median(batches)}


def _trace(run_dir: Path) -> list:
    path = run_dir / "step_trace.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def median_steps(peers: Sequence[Mapping]) -> dict[int, float]:
    """Per batch, the median of the offline steps several `offline_step` runs timed (e.g.
    one before and one after the served runs: one run alone varied by a tenth from one to
    the next); only batches every run timed."""
    tables = [{int(b): float(ms) for b, ms in p["decode_step_ms"].items()} for p in peers]
    common = set.intersection(*(set(t) for t in tables)) if tables else set()
    return {b: statistics.median(t[b] for t in tables) for b in sorted(common)}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    peers = [json.loads(Path(a).read_text()) for a in args if Path(a).is_file()]
    if not peers:
        print("no offline_step JSON given", file=sys.stderr)
        return 2
    offline = peers[0]
    steps = median_steps(peers)
    rows = []
    for d in [a for a in args if not Path(a).is_file()]:
        row = run_row(json.loads((Path(d) / "serve.json").read_text()), steps)
        row.update(engine_step_ratio(_trace(Path(d)), steps))
        rows.append(row)
        print(f"{d}: ITL p50 {row['itl_p50_ms']:.1f} ms at batch {row['batch']:g} = "
              f"{row['ratio']:.2f}x offline step {row['offline_step_ms']:.1f} ms; TTFT p50 "
              f"{row['ttft_p50_s']:.2f} s, {row['output_tok_s']:.1f} tok/s, "
              f"{row['failed']} failed", flush=True)
        if "engine_decode_steps" in row:
            print(f"  engine's own decode-only steps ({row['engine_decode_steps']} caught, "
                  f"batch p50 {row['engine_decode_batch_p50']:g}): "
                  f"{row['engine_decode_ratio_p50']:.2f}x the offline step at their batch "
                  f"(fastest tenth {row['engine_decode_ratio_p10']:.2f}x)", flush=True)
    print(json.dumps({"bench": "itl_peer", "runs": rows,
                      "ratio_median": statistics.median(r["ratio"] for r in rows),
                      "itl_p50_ms_median": statistics.median(r["itl_p50_ms"] for r in rows),
                      "offline_step_ms": {str(k): v for k, v in sorted(steps.items())},
                      "num_threads": offline.get("num_threads"),
                      "cpu": offline.get("cpu") or platform.processor() or platform.machine()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
