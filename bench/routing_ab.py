"""`pdserve bench routing`: router policies against each other on one colocated fleet shape,
one stack at a time.

Each policy gets a fresh `pdserve up --mode colocated --replicas N` (its router started with
`--decode-policy POLICY`) and a short warm-up (other prompts); then every seed's workload runs
in it, one after another (`--stack-per run`: a fresh stack for each (seed, policy) instead,
the policy order alternating per seed so a drift of the machine's load favours neither). A
stack is stopped before the next one starts, so no two ever share the cores. Each run also
records how the router spread the calls (pdserve_router_routed per instance), the engines'
prefix-cache hit share (vllm:prefix_cache_hits / queries, over the measured run only) and the
load average before and after. Reported: per policy the median over seeds of TTFT p50 (all
turns, and turns after the first), and each policy's medians over the first policy's (e.g.
round_robin first: kv_aware / round_robin); one JSON line at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Optional

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.routing_probe import StackProbe
from pdserve.bench.serve import ServeConfig, build, config_json, headline, measure, ratio
from pdserve.bench.stack import StackSpec, check_up_accepts, running_stack
from pdserve.bench.stats import percentile
from pdserve.services.router.routing.routing_config import POLICIES


@dataclass(frozen=True)
class RoutingABConfig:
    serve: ServeConfig  # the workload, arrivals and target API; addresses are filled in
    policies: tuple[str, ...] = ("round_robin", "kv_aware")  # ratios are over the first
    seeds: tuple[int, ...] = (1, 2, 3)
    model: str = "smollm2"
    replicas: int = 2
    num_threads: int = 1  # torch threads per replica (`up` pins one core each when it can)
    stack_args: tuple[str, ...] = ()  # more `pdserve up` options
    warmup: int = 4  # requests before the measured runs (two at a time, other prompts)
    stack_per: str = "policy"  # policy: one stack per policy, the seeds one after another in
    # it (distinct prompts, so no seed hits another's cache); run: a fresh stack every run
    startup_timeout_s: float = 300.0

    def __post_init__(self):
        if len(self.policies) < 2 or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"need two or more distinct policies, got {self.policies}")
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ValueError(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
        if self.stack_per not in ("policy", "run"):
            raise ValueError(f"stack_per must be policy or run, got {self.stack_per!r}")
        if not self.seeds or self.replicas < 2 or self.num_threads < 1 or self.warmup < 0:
            raise ValueError("need seeds, replicas >= 2, num_threads >= 1 and warmup >= 0")

    def spec(self, policy: str) -> StackSpec:
        args = ("--replicas", str(self.replicas), "--num-threads", str(self.num_threads),
                "--router-arg=--decode-policy", f"--router-arg={policy}", *self.stack_args)
        return StackSpec("colocated", self.model, args, self.startup_timeout_s)


_WARM_SEED = 10_007  # the warm-up's prompts: none of a measured seed's


def run_order(policies: tuple[str, ...], seed_index: int) -> tuple[str, ...]:
    """Seed 0 in the given order, seed 1 reversed, and so on."""
    return policies if seed_index % 2 == 0 else tuple(reversed(policies))


@contextlib.contextmanager
def policy_stack(cfg: RoutingABConfig, policy: str):
    """A fresh stack whose router uses `policy`, warmed up; yields (target, probe)."""
    warm_cfg = replace(cfg.serve, workload=replace(cfg.serve.workload, seed=_WARM_SEED),
                       arrivals=ArrivalConfig(kind="concurrency", concurrency=2))
    warm = build(warm_cfg)[:cfg.warmup]
    with tempfile.TemporaryDirectory(prefix=f"pdserve-routing-{policy}-") as d:
        with running_stack(cfg.spec(policy), Path(d)) as stack:
            target = replace(cfg.serve.target, base_url=stack.http_url,
                             grpc_addr=stack.grpc_addr, label=policy, tls_dir=stack.tls_dir)
            if warm:  # first forwards and first-touch pages, not measured
                measure(target, warm, replace(warm_cfg, target=target))
            yield target, StackProbe(stack.http_url, Path(d) / "services.json")


def measured_run(cfg: RoutingABConfig, target, probe: StackProbe, seed: int) -> dict:
    serve = replace(cfg.serve, target=target,
                    workload=replace(cfg.serve.workload, seed=seed))
    requests = build(serve)
    before, load0 = probe.read(), os.getloadavg()[0]
    summary, records = measure(target, requests, serve)
    after, load1 = probe.read(), os.getloadavg()[0]
    hits = after.hit_tokens - before.hit_tokens
    queries = after.query_tokens - before.query_tokens
    later = [rec.ttft_s for rec, req in zip(records, requests) if req.turn > 0 and rec.ok]
    _save(cfg, target.label, seed, records)
    return {"policy": target.label, "seed": seed, **headline(summary),
            "ttft_later_turns_p50_s": percentile(later, 50) if later else None,
            "routed": {a: n - before.routed.get(a, 0) for a, n in after.routed.items()},
            "prefix_hit_share": round(hits / queries, 4) if queries else None,
            "loadavg_1m": [round(load0, 2), round(load1, 2)]}


def _save(cfg: RoutingABConfig, policy: str, seed: int, records) -> None:
    out = Path(cfg.serve.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"routing_{policy}_seed{seed}.json").write_text(
        json.dumps([r.to_json() for r in records]))


def summarize(runs: list[dict], policies: tuple[str, ...]) -> dict:
    """Medians over seeds per policy, and each policy's median TTFT p50 over the first's."""
    per = {}
    for p in policies:
        mine = [r for r in runs if r["policy"] == p]
        per[p] = {k: _median([r[k] for r in mine]) for k in
                  ("ttft_p50_s", "ttft_later_turns_p50_s", "ttft_p99_s", "itl_p50_s",
                   "request_throughput", "prefix_hit_share")}
        per[p]["ttft_p50_s_by_seed"] = [r["ttft_p50_s"] for r in mine]
    base = policies[0]
    ratios = {p: ratio(per[p]["ttft_p50_s"], per[base]["ttft_p50_s"]) for p in policies[1:]}
    later = {p: ratio(per[p]["ttft_later_turns_p50_s"], per[base]["ttft_later_turns_p50_s"])
             for p in policies[1:]}
    return {"medians": per, f"ttft_p50_ratio_vs_{base}": ratios,
            f"ttft_later_turns_p50_ratio_vs_{base}": later}


def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return median(xs) if xs else None


def run_routing_ab(cfg: RoutingABConfig) -> dict:
    for p in cfg.policies:
        check_up_accepts(cfg.spec(p))
    runs = []

    def one(target, probe, seed):
        runs.append(measured_run(cfg, target, probe, seed))
        print(format_run(runs[-1]), flush=True)

    if cfg.stack_per == "run":
        for i, seed in enumerate(cfg.seeds):
            for policy in run_order(cfg.policies, i):
                with policy_stack(cfg, policy) as (target, probe):
                    one(target, probe, seed)
    else:
        for policy in cfg.policies:
            with policy_stack(cfg, policy) as (target, probe):
                for seed in cfg.seeds:
                    one(target, probe, seed)
    return {"bench": "routing", "model": cfg.model, "replicas": cfg.replicas,
            "num_threads": cfg.num_threads, "policies": list(cfg.policies),
            "seeds": list(cfg.seeds), "stack_per": cfg.stack_per,
            "workload": config_json(cfg.serve)["workload"],
            "arrivals": cfg.serve.arrivals.describe(), **summarize(runs, cfg.policies),
            "runs": runs}


def format_run(run: dict) -> str:
    s = (lambda x: "-" if x is None else f"{x:.3f}s")
    share = run["prefix_hit_share"]
    return (f"seed {run['seed']} {run['policy']:<12} TTFT p50 {s(run['ttft_p50_s'])} "
            f"(later turns {s(run['ttft_later_turns_p50_s'])}) p99 {s(run['ttft_p99_s'])}  "
            f"prefix hits {'-' if share is None else share}  "
            f"routed {sorted(run['routed'].values())}  load {run['loadavg_1m']}  "
            f"failed {run['failed']}/{run['requests']}")


def add_routing_subcommand(sub) -> None:
    from pdserve.bench import cli_args as ca

    p = sub.add_parser("routing", help="router policies on `up --mode colocated --replicas N`,"
                                       " one stack at a time (e.g. kv_aware vs round_robin)")
    ca.add_target_args(p, with_address=False)
    ca.add_load_args(p)
    g = p.add_argument_group("stacks")
    g.add_argument("--policies", default="round_robin,kv_aware",
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
    g.add_argument("--stack-per", choices=["policy", "run"], default="policy",
                   help="policy: one stack per policy, every seed in it; run: a fresh stack "
                        "per (seed, policy), the order alternating per seed (slower)")
    p.set_defaults(func=_main)


class _Stopped(Exception):
    """SIGTERM arrived: unwinds through running_stack, which stops the stack."""


def _stop(signum, frame):
    raise _Stopped()


def _main(args) -> int:
    import json
    import shlex

    from pdserve.bench import cli_args as ca
    from pdserve.bench.offline import cpu_name
    from pdserve.bench.stack import StackUnavailable

    args.tokenizer = args.tokenizer or args.model  # the stacks serve --model
    serve = ca.serve_config_from(args, ca.target_from(args, "http://127.0.0.1:1",
                                                      "127.0.0.1:1"))
    cfg = RoutingABConfig(serve, policies=tuple(p for p in args.policies.split(",") if p),
                          seeds=args.seeds, model=args.model, replicas=args.replicas,
                          num_threads=args.num_threads,
                          stack_args=tuple(shlex.split(args.stack_args)), warmup=args.warmup,
                          stack_per=args.stack_per, startup_timeout_s=args.startup_timeout)
    signal.signal(signal.SIGTERM, _stop)  # e.g. `timeout`: stop the running stack too
    try:
        line = {"cpu": cpu_name(), **run_routing_ab(cfg)}
    except StackUnavailable as exc:
        line = {"bench": "routing", "error": str(exc).splitlines()[0]}
    except _Stopped:
        line = {"bench": "routing", "error": "stopped by SIGTERM; the finished runs' lines "
                                             "are above"}
    failed = sum(r["failed"] for r in line.get("runs", ()))
    line["failed"] = failed
    print(json.dumps(line, separators=(",", ":")), flush=True)
    return 2 if "error" in line else (3 if failed else 0)
