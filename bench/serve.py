"""`pdserve bench serve`: one load run against one server (and optionally a peer after it).

The peer gets exactly the same requests on exactly the same schedule (the same seed), so the
ratios printed at the end compare like with like.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.failures import FailureTally, banner, tally, verdict
from pdserve.bench.plots import plot_latency_cdfs
from pdserve.bench.record import RequestRecord
from pdserve.bench.request import BenchRequest
from pdserve.bench.runner import run_load
from pdserve.bench.slo import TierSLO, slo_for
from pdserve.bench.summary import summarize_run
from pdserve.bench.target import TargetConfig, make_client
from pdserve.bench.workload_config import WorkloadConfig


@dataclass(frozen=True)
class ServeConfig:
    target: TargetConfig
    workload: WorkloadConfig
    arrivals: ArrivalConfig
    slos: tuple[TierSLO, ...] = ()
    tokenizer: str = "smollm2"  # where prompts are tokenized and lengths counted
    out_dir: str = "bench-results"
    progress: bool = True
    peer: Optional[TargetConfig] = None
    keep_requests: bool = True  # per-request records in the result file
    chaos: Optional[object] = None  # a chaos.ChaosConfig: also run with faults injected

    def __post_init__(self):
        names = [s.tier for s in self.slos]
        if len(set(names)) != len(names):
            raise ValueError(f"an SLO is given twice for one tier: {names}")

    @property
    def slo_map(self) -> dict[str, TierSLO]:
        return {s.tier: s for s in self.slos}


async def _run(target: TargetConfig, requests: Sequence[BenchRequest], cfg: ServeConfig):
    client = make_client(target)
    await client.start()
    try:
        return await run_load(requests, client, cfg.arrivals, cfg.workload.seed, cfg.progress)
    finally:
        await client.close()


def measure(target: TargetConfig, requests: Sequence[BenchRequest],
            cfg: ServeConfig) -> tuple[dict, tuple[RequestRecord, ...]]:
    out = asyncio.run(_run(target, requests, cfg))
    return summarize_run(out.records, out.duration_s, cfg.slo_map), out.records


def write_outputs(summary: dict, records, cfg: ServeConfig, out_dir: Path, stem: str) -> dict:
    """The result JSON and the CDF plot; returns {'result': path, 'plots': [paths]}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = {t: (slo_for(t, cfg.slo_map).ttft_s, slo_for(t, cfg.slo_map).itl_s)
             for t in summary["tiers"]}
    png = plot_latency_cdfs(records, out_dir / f"{stem}_cdf.png", lines,
                            f"{stem}: latency CDFs by tier")
    body = dict(config=config_json(cfg), **summary)
    if cfg.keep_requests:
        body["per_request"] = [r.to_json() for r in records]
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(body, indent=1))
    return {"result": str(path), "plots": [str(png)]}


def config_json(cfg: ServeConfig) -> dict:
    wl = asdict(cfg.workload)
    for k in ("input_len", "output_len", "prefix_len"):
        wl[k] = str(getattr(cfg.workload, k))
    return {"target": asdict(cfg.target), "workload": wl, "arrivals": asdict(cfg.arrivals),
            "slos": [s.to_json() for s in cfg.slos], "tokenizer": cfg.tokenizer,
            "peer": asdict(cfg.peer) if cfg.peer else None,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def headline(summary: dict) -> dict:
    """The figures a one-line JSON carries for one run."""
    return {"requests": summary["requests"], "failed": summary["failed"],
            "duration_s": summary["duration_s"],
            "request_throughput": summary["request_throughput"],
            "output_throughput": summary["output_throughput"],
            "goodput_rps": summary["goodput_rps"], "attainment": summary["attainment"],
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
            "itl_p50_s": summary["itl_s"]["p50"], "itl_p99_s": summary["itl_s"]["p99"],
            "tpot_p50_s": summary["tpot_s"]["p50"],
            "tiers": {t: {"attainment": b["attainment"], "goodput_rps": b["goodput_rps"]}
                      for t, b in summary["tiers"].items()}}


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def peer_ratios(ours: dict, peer: dict) -> dict:
    """ours / peer: above 1 is better for throughput and goodput, worse for latencies."""
    keys = ("request_throughput", "output_throughput", "goodput_rps", "ttft_p50_s",
            "ttft_p99_s", "itl_p50_s", "itl_p99_s", "tpot_p50_s")
    return {k: ratio(ours[k], peer[k]) for k in keys}


def build(cfg: ServeConfig) -> list[BenchRequest]:
    from pdserve.bench.text_gen import load_tokenizer
    from pdserve.bench.workload import build_requests

    return build_requests(cfg.workload, load_tokenizer(cfg.tokenizer))


def run_serve(cfg: ServeConfig, stem: str = "serve") -> dict:
    """Runs, prints the table(s), writes files; returns the one-line JSON's dict."""
    from pdserve.bench.report import format_table

    requests = build(cfg)
    out_dir = Path(cfg.out_dir)
    summary, records = measure(cfg.target, requests, cfg)
    print(format_table(summary, f"== {cfg.target.name}: {cfg.arrivals.describe()}"), flush=True)
    line = dict(bench="serve", target=cfg.target.name, **headline(summary),
                **write_outputs(summary, records, cfg, out_dir, stem))
    line["failures"] = tally([summary])
    if cfg.chaos is not None:
        line["chaos"] = _chaos_run(cfg, requests, summary, records)
    if cfg.peer is not None:
        psum, precs = measure(cfg.peer, requests, replace(cfg, target=cfg.peer))
        print(format_table(psum, f"== peer {cfg.peer.name}"), flush=True)
        write_outputs(psum, precs, replace(cfg, target=cfg.peer), out_dir, f"{stem}_peer")
        line["peer"] = dict(target=cfg.peer.name, **headline(psum), failures=tally([psum]))
        line["ratio_vs_peer"] = peer_ratios(headline(summary), line["peer"])
    return line


def settle_failures(line: dict, max_fraction: float) -> int:
    """Replaces each side's `failures` tally (run_serve's) with its JSON fields, on that
    side's own block: the top level counts our run only, never ours plus the peer's (which
    once reported 64 requests for a 32-request run with a peer). Prints the banner of a side
    past the threshold; the exit code is the worse side's."""
    code = 0
    for side in (line, line.get("peer")):
        if side is None:
            continue
        t: FailureTally = side.pop("failures")
        fields, side_code = verdict(t, max_fraction)
        side.update(fields)
        if side_code:
            print(banner(t) or fields["error"], file=sys.stderr, flush=True)
            print(f"pdserve bench serve ({side['target']}): {fields['error']}",
                  file=sys.stderr, flush=True)
        code = max(code, side_code)
    return code


def _chaos_run(cfg: ServeConfig, requests, summary: dict, records) -> dict:
    """The same load again while engines are killed; compared with the run without faults."""
    from pdserve.bench.chaos import Chaos, right_text_share
    from pdserve.bench.report import format_table

    chaos = Chaos(cfg.chaos).start()
    try:
        csum, crecs = measure(cfg.target, requests, cfg)
    finally:
        kills = chaos.stop()
    print(format_table(csum, f"== {cfg.target.name} with a kill every "
                             f"{cfg.chaos.every_s:g}s ({len(kills)} kills)"), flush=True)
    return {"kills": kills, "skipped_ticks": chaos.skipped,
            "right_text_share": right_text_share(records, crecs),
            "failed": csum["failed"], "goodput_rps": csum["goodput_rps"],
            "goodput_ratio_vs_no_faults": ratio(csum["goodput_rps"], summary["goodput_rps"]),
            "output_throughput_ratio_vs_no_faults": ratio(csum["output_throughput"],
                                                          summary["output_throughput"])}
