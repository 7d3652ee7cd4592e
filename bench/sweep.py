"""`pdserve bench sweep`: SLO attainment against request rate, per tier.

Each rate is measured `repeats` times on the same requests and schedule; the curve uses the
median attainment. The SLO rate is DistServe's goodput: the highest rate at which at least
`target` (90%) of requests meet their SLOs, interpolated linearly inside the first bracket
where attainment falls below the target (None when even the lowest rate misses it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.failures import banner, tally
from pdserve.bench.goodput import OVERALL
from pdserve.bench.plots import plot_attainment
from pdserve.bench.serve import ServeConfig, build, headline, measure, write_outputs
from pdserve.bench.stats import median


@dataclass(frozen=True)
class SweepConfig:
    serve: ServeConfig
    rates: tuple[float, ...]
    repeats: int = 1
    target: float = 0.9
    warmup: int = 4  # requests before the first rate, not measured: a cold server's first
    # requests (first forwards, first-touch KV pages) would count against the lowest rate

    def __post_init__(self):
        if not self.rates or any(not r > 0 or r == float("inf") for r in self.rates):
            raise ValueError(f"rates must be finite and > 0, got {self.rates}")
        if self.serve.arrivals.kind == "concurrency":
            raise ValueError("a rate sweep needs a rate-driven arrival kind, not concurrency")
        if self.repeats < 1 or not 0 < self.target <= 1:
            raise ValueError("repeats must be >= 1 and target in (0, 1]")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


def max_rate_meeting(points: Sequence[tuple[float, float]], target: float) -> Optional[float]:
    """Highest rate with attainment >= target, interpolated at the first crossing."""
    pts = sorted(points)
    best = None
    for k, (rate, att) in enumerate(pts):
        if att < target:
            if best is None:
                return None
            r0, a0 = pts[k - 1]
            return r0 + (a0 - target) * (rate - r0) / (a0 - att)
        best = rate
    return best


def curves_from_points(points: Sequence[dict]) -> dict[str, list[tuple[float, float]]]:
    """[{rate, attainment: {tier: [a, ...]}}] -> {tier: [(rate, median a), ...]}."""
    out: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        for tier, values in p["attainment"].items():
            out.setdefault(tier, []).append((p["rate"], median(values)))
    return out


def _requests(cfg: SweepConfig, run: int):
    """The workload of one run: same shape, its own prompts (seed + run + 1), so a server's
    prefix cache cannot turn a later rate's prompts into hits from an earlier run."""
    workload = cfg.serve.workload
    return build(replace(cfg.serve, workload=replace(workload, seed=workload.seed + run + 1)))


def run_sweep(cfg: SweepConfig, stem: str = "sweep", label: str = "") -> dict:
    out_dir = Path(cfg.serve.out_dir)
    if cfg.warmup:
        warm = replace(cfg.serve, arrivals=ArrivalConfig(kind="concurrency", concurrency=2))
        measure(warm.target, _requests(cfg, -1)[:cfg.warmup], warm)
    points, tallies = [], []
    for i, rate in enumerate(cfg.rates):
        run_cfg = replace(cfg.serve, arrivals=replace(cfg.serve.arrivals, rate=rate))
        att: dict[str, list[float]] = {}
        runs = []
        for rep in range(cfg.repeats):
            requests = _requests(cfg, i * cfg.repeats + rep)
            summary, records = measure(run_cfg.target, requests, run_cfg)
            write_outputs(summary, records, run_cfg, out_dir, f"{stem}_rate{rate:g}_r{rep}")
            runs.append(headline(summary))
            tallies.append({k: summary[k] for k in ("requests", "failed", "errors")})
            loud = banner(tally(tallies[-1:]))
            if loud:  # before the attainment line, which would read as a slow server
                print(loud, flush=True)
            att.setdefault(OVERALL, []).append(summary["attainment"])
            for tier, block in summary["tiers"].items():
                att.setdefault(tier, []).append(block["attainment"])
            print(f"rate {rate:g} req/s run {rep + 1}/{cfg.repeats}: attainment "
                  + ", ".join(f"{t} {a[-1] * 100:.0f}%" for t, a in att.items()), flush=True)
        points.append({"rate": rate, "attainment": att, "runs": runs})
    curves = curves_from_points(points)
    max_rate = {t: max_rate_meeting(c, cfg.target) for t, c in curves.items()}
    name = label or cfg.serve.target.name
    png = plot_attainment({name: curves}, out_dir / f"{stem}_attainment.png", cfg.target)
    body = {"target": name, "slo_target": cfg.target, "rates": list(cfg.rates),
            "repeats": cfg.repeats, "curves": curves, "max_rate": max_rate, "points": points}
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(body, indent=1))
    failures = tally(tallies)
    return {"bench": "sweep", "target": name, **failures.to_json(), "rates": list(cfg.rates),
            "curves": curves, "max_rate": max_rate, "result": str(path), "plots": [str(png)],
            "failures": failures}
