"""`pdserve bench routing`: router policies against each other on one colocated fleet shape,
one stack at a time.

For every seed, each policy gets a fresh `pdserve up --mode colocated --replicas N` (its router
started with `--decode-policy POLICY`), a short warm-up (other prompts), then the seed's
workload; the stack is stopped before the next one starts, so no two stacks ever share the
cores. The policy order alternates from seed to seed (a slow drift of the machine's load
does not favour one policy). Each run also records how the router spread the calls
(pdserve_router_routed per instance), the engines' prefix-cache hit share (vllm:prefix_cache_
hits / queries, over the measured run only) and the load average before and after.
Reported: per policy the median over seeds of TTFT p50 / p99, and each policy's median TTFT
p50 over the first policy's (e.g. kv_aware / round_robin); one JSON line at the end.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Optional

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.routing_probe import StackProbe
from pdserve.bench.serve import ServeConfig, build, headline, measure, ratio
from pdserve.bench.stack import StackSpec, check_up_accepts, running_stack
from pdserve.services.router.routing.routing_config import POLICIES


@dataclass(frozen=True)
class RoutingABConfig:
    serve: ServeConfig  # the workload, arrivals and target API; addresses are filled in
    policies: tuple[str, ...] = ("kv_aware", "round_robin")
    seeds: tuple[int, ...] = (1, 2, 3)
    model: str = "smollm2"
    replicas: int = 2
    num_threads: int = 1  # torch threads per replica (`up` pins one core each when it can)
    stack_args: tuple[str, ...] = ()  # more `pdserve up` options
    warmup: int = 4  # requests before the measured run (two at a time, other prompts)
    startup_timeout_s: float = 300.0

    def __post_init__(self):
        if len(self.policies) < 2 or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"need two or more distinct policies, got {self.policies}")
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ValueError(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
        if not self.seeds or self.replicas < 2 or self.num_threads < 1 or self.warmup < 0:
            raise ValueError("need seeds, replicas >= 2, num_threads >= 1 and warmup >= 0")

    def spec(self, policy: str) -> StackSpec:
        args = ("--replicas", str(self.replicas), "--num-threads", str(self.num_threads),
                "--router-arg=--decode-policy", f"--router-arg={policy}", *self.stack_args)
        return StackSpec("colocated", self.model, args, self.startup_timeout_s)


def run_order(policies: tuple[str, ...], seed_index: int) -> tuple[str, ...]:
    """Seed 0 in the given order, seed 1 reversed, and so on."""
    return policies if seed_index % 2 == 0 else tuple(reversed(policies))


def one_run(cfg: RoutingABConfig, policy: str, seed: int, out_dir: Path) -> dict:
    serve = replace(cfg.serve, workload=replace(cfg.serve.workload, seed=seed))
    requests = build(serve)
    warm_cfg = replace(serve, workload=replace(serve.workload, seed=seed + 10_000),
                       arrivals=ArrivalConfig(kind="concurrency", concurrency=2))
    warm = build(warm_cfg)[:cfg.warmup]
    with tempfile.TemporaryDirectory(prefix=f"pdserve-routing-{policy}-") as d:
        with running_stack(cfg.spec(policy), Path(d)) as stack:
            target = replace(serve.target, base_url=stack.http_url, grpc_addr=stack.grpc_addr,
                             label=policy, tls_dir=stack.tls_dir)
            probe = StackProbe(stack.http_url, Path(d) / "services.json")
            if warm:
                measure(target, warm, replace(warm_cfg, target=target))
            before, load0 = probe.read(), os.getloadavg()[0]
            summary, _ = measure(target, requests, replace(serve, target=target))
            after, load1 = probe.read(), os.getloadavg()[0]
    hits = after.hit_tokens - before.hit_tokens
    queries = after.query_tokens - before.query_tokens
    routed = {a: n - before.routed.get(a, 0) for a, n in after.routed.items()}
    return {"policy": policy, "seed": seed, **headline(summary),
            "routed": routed, "prefix_hit_share": round(hits / queries, 4) if queries else None,
            "loadavg_1m": [round(load0, 2), round(load1, 2)]}


def summarize(runs: list[dict], policies: tuple[str, ...]) -> dict:
    """Medians over seeds per policy, and each policy's median TTFT p50 over the first's."""
    per = {}
    for p in policies:
        mine = [r for r in runs if r["policy"] == p]
        per[p] = {k: _median([r[k] for r in mine]) for k in
                  ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "request_throughput",
                   "prefix_hit_share")}
        per[p]["ttft_p50_s_by_seed"] = [r["ttft_p50_s"] for r in mine]
    base = policies[0]
    ratios = {p: ratio(per[p]["ttft_p50_s"], per[base]["ttft_p50_s"]) for p in policies[1:]}
    return {"medians": per, f"ttft_p50_ratio_vs_{base}": ratios}


def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return median(xs) if xs else None


def run_routing_ab(cfg: RoutingABConfig) -> dict:
    for p in cfg.policies:
        check_up_accepts(cfg.spec(p))
    out_dir = Path(cfg.serve.out_dir)
    runs = []
    for i, seed in enumerate(cfg.seeds):
        for policy in run_order(cfg.policies, i):
            run = one_run(cfg, policy, seed, out_dir)
            print(format_run(run), flush=True)
            runs.append(run)
    return {"bench": "routing", "model": cfg.model, "replicas": cfg.replicas,
            "num_threads": cfg.num_threads, "policies": list(cfg.policies),
            "seeds": list(cfg.seeds), "workload": cfg.serve.workload.kind,
            "arrivals": cfg.serve.arrivals.describe(), **summarize(runs, cfg.policies),
            "runs": runs}


def format_run(run: dict) -> str:
    share = run["prefix_hit_share"]
    return (f"seed {run['seed']} {run['policy']:<12} TTFT p50 {run['ttft_p50_s']:.3f}s "
            f"p99 {run['ttft_p99_s']:.3f}s  prefix hits {'-' if share is None else share:}  "
            f"routed {sorted(run['routed'].values())}  load {run['loadavg_1m']}  "
            f"failed {run['failed']}/{run['requests']}")


def add_routing_subcommand(sub) -> None:
    from pdserve.bench import cli_args as ca

    p = sub.add_parser("routing", help="router policies on `up --mode colocated --replicas N`,"
                                       " one stack at a time (e.g. kv_aware vs round_robin)")
    ca.add_target_args(p, with_address=False)
    ca.add_load_args(p)
    g = p.add_argument_group("stacks")
    g.add_argument("--policies", default="kv_aware,round_robin",
                   help="comma-separated --decode-policy values; ratios are over the first")
    g.add_argument("--seeds", default="1,2,3", type=ca.parse_cores,
                   help="comma-separated workload seeds; each runs once per policy "
                        "(--seed is ignored)")
    g.add_argument("--model", default="smollm2", help="what `pdserve up --model` serves")
    g.add_argument("--replicas", type=int, default=2, help="unified engines")
    g.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    g.add_argument("--stack-args", default="",
                   help="more `pdserve up` options, e.g. '--max-model-len 4096'")
    g.add_argument("--warmup", type=int, default=4,
                   help="requests (other prompts) sent before each measured run")
    g.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds each stack may take to become healthy")
    p.set_defaults(func=_main)


def _main(args) -> int:
    import json
    import shlex

    from pdserve.bench import cli_args as ca
    from pdserve.bench.offline import cpu_name
    from pdserve.bench.stack import StackUnavailable

    args.tokenizer = args.tokenizer or args.model  # the stacks serve --model
    serve = ca.serve_config_from(args, ca.target_from(args, "http://127.0.0.1:1",
                                                      "127.0.0.1:1"))
    cfg = RoutingABConfig(serve, tuple(p for p in args.policies.split(",") if p),
                          args.seeds, args.model, args.replicas, args.num_threads,
                          tuple(shlex.split(args.stack_args)), args.warmup,
                          args.startup_timeout)
    try:
        line = {"cpu": cpu_name(), **run_routing_ab(cfg)}
    except StackUnavailable as exc:
        line = {"bench": "routing", "error": str(exc).splitlines()[0]}
    failed = sum(r["failed"] for r in line.get("runs", ()))
    line["failed"] = failed
    print(json.dumps(line, separators=(",", ":")), flush=True)
    return 2 if "error" in line else (3 if failed else 0)
