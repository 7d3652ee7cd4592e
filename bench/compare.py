"""`pdserve bench compare`: colocated against disaggregated, the same sweep against each.

Both stacks are started here (`pdserve up --mode ...`), one after the other so they never share
the cores: colocated gets every core with one torch thread per core; disaggregated gets prefill
on the first half of the cores and decode on the rest, threads = cores each, so neither
oversubscribes. Both modes are checked before anything runs, so a missing disagg mode fails
in seconds, not after the colocated sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from pdserve.bench.failures import FailureTally
from pdserve.bench.plots import plot_attainment
from pdserve.bench.serve import ratio
from pdserve.bench.stack import StackSpec, check_up_accepts, running_stack
from pdserve.bench.sweep import SweepConfig, run_sweep

MODES = ("colocated", "disagg")


def default_stack_args(mode: str, cores: tuple[int, ...]) -> tuple[str, ...]:
    """Pinning and threads per mode; disagg splits the cores between prefill and decode."""
    if mode == "colocated":
        return ("--cpus", ",".join(map(str, cores)), "--num-threads", str(len(cores)))
    half = max(1, len(cores) // 2)
    pre, dec = cores[:half], cores[half:] or cores[:half]
    return ("--prefill-cpus", ",".join(map(str, pre)), "--prefill-threads", str(len(pre)),
            "--decode-cpus", ",".join(map(str, dec)), "--decode-threads", str(len(dec)))


@dataclass(frozen=True)
class CompareConfig:
    sweep: SweepConfig  # its serve.target says which API (http or grpc); addresses are filled in
    model: str = "smollm2"
    cores: tuple[int, ...] = (0, 1)
    colocated_args: Optional[tuple[str, ...]] = None  # None -> default_stack_args
    disagg_args: Optional[tuple[str, ...]] = None
    common_args: tuple[str, ...] = ()  # appended for both modes (e.g. --max-model-len)
    modes: tuple[str, ...] = MODES  # one mode alone: its sweep, no ratio
    startup_timeout_s: float = 300.0

    def __post_init__(self):
        if not self.cores or any(c < 0 for c in self.cores):
            raise ValueError(f"cores must be a non-empty list of core ids, got {self.cores}")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be some of {MODES}, got {self.modes}")

    def spec(self, mode: str) -> StackSpec:
        given = self.colocated_args if mode == "colocated" else self.disagg_args
        args = given if given is not None else default_stack_args(mode, self.cores)
        return StackSpec(mode, self.model, tuple(args) + self.common_args,
                         self.startup_timeout_s)


def run_compare(cfg: CompareConfig) -> dict:
    for mode in cfg.modes:
        check_up_accepts(cfg.spec(mode))
    out_dir = Path(cfg.sweep.serve.out_dir)
    results = {}
    for mode in cfg.modes:
        with running_stack(cfg.spec(mode), out_dir / f"logs_{mode}") as stack:
            target = replace(cfg.sweep.serve.target, base_url=stack.http_url,
                             grpc_addr=stack.grpc_addr, label=mode, tls_dir=stack.tls_dir)
            sweep = replace(cfg.sweep, serve=replace(cfg.sweep.serve, target=target))
            results[mode] = run_sweep(sweep, stem=f"compare_{mode}", label=mode)
    png = plot_attainment({m: r["curves"] for m, r in results.items()},
                          out_dir / "compare_attainment.png", cfg.sweep.target,
                          "SLO attainment per tier: colocated vs disaggregated")
    ratios = None
    if len(results) == 2:
        co, dis = results["colocated"]["max_rate"], results["disagg"]["max_rate"]
        ratios = {t: ratio(dis.get(t), co.get(t)) for t in sorted(set(co) | set(dis))}
    _print_ratios(results, ratios)
    failures = {m: r.pop("failures") for m, r in results.items()}
    total = FailureTally(sum(f.requests for f in failures.values()),
                         sum(f.failed for f in failures.values()),
                         tuple(e for f in failures.values() for e in f.errors))
    return {"bench": "compare", **total.to_json(),
            "failed_by_mode": {m: f.failed for m, f in failures.items()},
            "failures": total, "rates": list(cfg.sweep.rates),
            "max_rate": {m: r["max_rate"] for m, r in results.items()},
            "goodput_ratio_disagg_vs_colocated": ratios,
            "results": {m: r["result"] for m, r in results.items()},
            "plots": [str(png)] + [p for r in results.values() for p in r["plots"]]}


def _print_ratios(results: dict, ratios: Optional[dict]) -> None:
    """Per tier: the SLO rate (goodput) of each stack and disagg / colocated."""
    fmt = (lambda x: "-" if x is None else f"{x:.2f}")
    tiers = sorted({t for r in results.values() for t in r["max_rate"]})
    print("SLO rate (req/s at >= target attainment) per tier:", flush=True)
    for t in tiers:
        cells = "  ".join(f"{m} {fmt(r['max_rate'].get(t))}" for m, r in results.items())
        tail = f"  disagg/colocated {fmt(ratios.get(t))}" if ratios else ""
        print(f"  {t:<12} {cells}{tail}", flush=True)
