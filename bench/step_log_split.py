"""The served engine's decode-only steps over the offline step, split by what differs per step.

    python -m pdserve.bench.step_log_split STEP_LOG OFFLINE_STEP_JSON [OFFLINE_STEP_JSON ...]

STEP_LOG is what the engine wrote with `PDSERVE_STEP_LOG=PATH` in its environment
(services/engine_host/step_log.py: every step, from the engine thread). A decode-only step
(as many tokens computed as rows sampled, every running request sampled) is divided by the
offline step at its batch (bench/itl_peer.py's interpolation, the median of the JSON files),
and the ratios are split by: steps since the last step with prompt tokens, whether the batch's
requests are the previous step's, the batch's mean context (KV tokens per row), and batch.
Each group prints its count and median ratio; the forward's share of the step and the engine
thread's CPU over wall are printed beside. Also the engine-side ITL p50 (every step's period,
start to the next step's start, weighted by the rows it sampled: what a stream sees leave the
engine) against the step's own wall so weighted, and the engine thread's time between steps
and its CPU share there. Then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from pdserve.bench.itl_peer import median_steps, step_at
from pdserve.bench.offline import cpu_name
from pdserve.bench.serve_step_trace import weighted_median
from pdserve.services.engine_host.step_log import StepLogRecord, read_step_log


@dataclass(frozen=True)
class DecodeStep:
    ratio: float  # wall over the offline step at the same batch
    batch: int
    mean_ctx: float  # KV tokens per row
    since_prompt: int
    same_batch: bool
    forward_share: float  # forward over wall
    cpu_share: float  # engine thread CPU over wall


def decode_steps(records: Sequence[StepLogRecord],
                 steps_ms: Mapping[int, float]) -> list[DecodeStep]:
    """The step log's decode-only steps, each against the offline step at its batch."""
    out = []
    for r in records:
        b = r.sampled
        if b == 0 or r.tokens != b or r.running != b or r.wall_ns <= 0:
            continue
        out.append(DecodeStep(r.wall_ns / 1e6 / step_at(steps_ms, b), b, r.ctx_sum / b,
                              r.since_prompt, r.same_batch, r.forward_ns / r.wall_ns,
                              r.cpu_ns / r.wall_ns))
    return out


def since_bin(n: int) -> str:
    return "1" if n == 1 else "2-4" if n <= 4 else "5-16" if n <= 16 else ">16"


def ctx_bin(ctx: float, width: int = 32) -> str:
    lo = int(ctx) // width * width
    return f"{lo}-{lo + width - 1}"


def batch_bin(b: int, width: int = 8) -> str:
    lo = b // width * width
    return f"{lo}-{lo + width - 1}"


def split(steps: Sequence[DecodeStep], key: Callable[[DecodeStep], str]) -> dict[str, dict]:
    """Per group: steps, median ratio, median forward and CPU share, median batch and ctx."""
    groups: dict[str, list[DecodeStep]] = {}
    for s in steps:
        groups.setdefault(key(s), []).append(s)
    return {k: {"steps": len(v),
                "ratio_p50": round(statistics.median(s.ratio for s in v), 3),
                "batch_p50": statistics.median(s.batch for s in v),
                "ctx_p50": round(statistics.median(s.mean_ctx for s in v), 1),
                "forward_share_p50": round(statistics.median(s.forward_share for s in v), 3),
                "cpu_share_p50": round(statistics.median(s.cpu_share for s in v), 3)}
            for k, v in sorted(groups.items())}


BUSY_GAP_NS = 100_000_000  # a longer gap between two steps is an idle spell, not the loop's


def between_steps(records: Sequence[StepLogRecord]) -> dict:
    """Token-weighted medians of the step's wall and of its period (to the next step's start),
    in ms, and the medians of the gaps between busy steps and of the CPU in them."""
    recs = sorted(records, key=lambda r: r.t_ns)
    walls = [(r.wall_ns / 1e6, r.sampled) for r in recs if r.sampled]
    periods = [((b.t_ns - a.t_ns) / 1e6, a.sampled) for a, b in zip(recs, recs[1:])
               if a.sampled and b.gap_ns < BUSY_GAP_NS]
    gaps = [r for r in recs[1:] if 0 < r.gap_ns < BUSY_GAP_NS]
    return {"engine_step_wall_p50_ms": round(weighted_median(walls), 2) if walls else None,
            "engine_itl_p50_ms": round(weighted_median(periods), 2) if periods else None,
            "gap_p50_ms": round(statistics.median(r.gap_ns for r in gaps) / 1e6, 3)
            if gaps else None,
            "gap_cpu_p50_ms": round(statistics.median(r.gap_cpu_ns for r in gaps) / 1e6, 3)
            if gaps else None}


SPLITS = {"all": lambda s: "all", "since_prompt": lambda s: since_bin(s.since_prompt),
          "same_batch": lambda s: str(s.same_batch), "mean_ctx": lambda s: ctx_bin(s.mean_ctx),
          "batch": lambda s: batch_bin(s.batch)}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    records = read_step_log(args[0])
    steps_ms = median_steps([json.loads(Path(a).read_text()) for a in args[1:]])
    steps = decode_steps(records, steps_ms)
    if not steps:
        print("no decode-only step in the log", file=sys.stderr)
        return 1
    out = {name: split(steps, key) for name, key in SPLITS.items()}
    gaps = between_steps(records)
    for name, groups in out.items():
        print(f"by {name}:")
        for k, g in groups.items():
            print(f"  {k:>9}: {g['steps']:5d} steps, {g['ratio_p50']:.3f}x offline "
                  f"(batch p50 {g['batch_p50']:g}, ctx {g['ctx_p50']:g}, forward "
                  f"{g['forward_share_p50']:.0%}, cpu {g['cpu_share_p50']:.0%})")
    print(f"engine-side ITL p50 {gaps['engine_itl_p50_ms']} ms (step wall alone "
          f"{gaps['engine_step_wall_p50_ms']} ms); between steps p50 {gaps['gap_p50_ms']} ms, "
          f"of it CPU {gaps['gap_cpu_p50_ms']} ms")
    print(json.dumps({"bench": "step_log_split", "records": len(records), **out, **gaps,
                      "offline_step_ms": {str(k): v for k, v in steps_ms.items()},
                      "cpu": cpu_name()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
