"""`pdserve bench ...`: serve, sweep, compare (offline, transport, kv, router live elsewhere).

`add_bench_subcommands(bench_sub)` adds serve, sweep and compare to the subparsers of the
top-level `bench` command (the ones offline, transport, kv and router are added to). Every
command ends by printing ONE JSON line with its figures and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from pdserve.bench import cli_args as ca


def add_bench_subcommands(sub) -> None:
    """Adds serve, sweep, compare, routing to `sub`, the subparsers of `pdserve bench`."""
    serve = sub.add_parser("serve", help="one load run against a server (ours or a peer)")
    ca.add_target_args(serve)
    ca.add_load_args(serve)
    serve.add_argument("--peer-base-url", default="",
                       help="also run the same requests against this OpenAI-compatible "
                            "server and print the ratios")
    serve.add_argument("--peer-model-name", default="",
                       help="the peer's model field ('': first of its /v1/models)")
    serve.set_defaults(func=_serve)

    sweep = sub.add_parser("sweep", help="SLO attainment against request rate")
    ca.add_target_args(sweep)
    ca.add_load_args(sweep)
    _sweep_args(sweep)
    sweep.set_defaults(func=_sweep)

    cmp_ = sub.add_parser("compare", help="colocated vs disaggregated: the same sweep on each")
    ca.add_target_args(cmp_, with_address=False)
    ca.add_load_args(cmp_)
    _sweep_args(cmp_)
    cmp_.add_argument("--model", default="smollm2", help="what `pdserve up --model` serves")
    cmp_.add_argument("--cores", default=",".join(map(str, sorted(os.sched_getaffinity(0)))),
                      help="comma-separated CPU ids both stacks run on (this "
                           "process's affinity)")
    cmp_.add_argument("--colocated-args", default=None,
                      help="options for `pdserve up --mode colocated` (None: pin to "
                           "--cores, one thread per core)")
    cmp_.add_argument("--disagg-args", default=None,
                      help="options for `pdserve up --mode disagg` (None: prefill and "
                           "decode on separate halves of --cores)")
    cmp_.add_argument("--stack-args", default="",
                      help="more options for `pdserve up` in both modes, e.g. "
                           "'--max-model-len 1024'")
    cmp_.add_argument("--modes", default="colocated,disagg",
                      help="which stacks to run; the ratio needs both")
    cmp_.add_argument("--startup-timeout", type=float, default=300.0,
                      help="seconds each stack may take to become healthy")
    cmp_.set_defaults(func=_compare)

    from pdserve.bench.routing_ab import add_routing_subcommand

    add_routing_subcommand(sub)  # policies against each other, one stack at a time
    from pdserve.bench.routing_sim import add_routing_sim_subcommand

    add_routing_sim_subcommand(sub)  # the same on simulated engines, in seconds


def _sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", type=ca.parse_rates, default=(0.5, 1.0, 2.0, 4.0),
                   help="comma-separated requests/s")
    p.add_argument("--repeats", type=int, default=1, help="runs per rate; medians reported")
    p.add_argument("--slo-target", type=float, default=0.9,
                   help="attainment that defines the SLO rate (DistServe: 0.9)")
    p.add_argument("--warmup", type=int, default=4,
                   help="requests sent (two at a time, not measured) before the first rate")


def _emit(line: dict) -> int:
    print(json.dumps(line, separators=(",", ":")), flush=True)
    return 0


def _finish(line: dict, failures, max_fraction: float) -> int:
    """Emits the JSON line with the failure fields; non-zero past the threshold."""
    from pdserve.bench.failures import banner, verdict

    fields, code = verdict(failures, max_fraction)
    line.update(fields)
    if code:
        print(banner(failures) or fields["error"], file=sys.stderr, flush=True)
        print(f"pdserve bench: {fields['error']}", file=sys.stderr, flush=True)
    _emit(line)
    return code


def _serve(args) -> int:
    from pdserve.bench.serve import run_serve, settle_failures
    from pdserve.bench.vocab import resolve_tokenizer

    target = ca.target_from(args)
    args.tokenizer = resolve_tokenizer(args.tokenizer, target)
    cfg = ca.serve_config_from(args, target)
    if args.peer_base_url:
        from dataclasses import replace

        peer = replace(cfg.target, api="http", base_url=args.peer_base_url,
                       model_name=args.peer_model_name, label="peer")
        cfg = replace(cfg, peer=peer)
    line = run_serve(cfg)
    code = settle_failures(line, args.max_failed_fraction)  # each side counts its own
    _emit(line)
    return code


def _sweep_config(args, target):
    from pdserve.bench.sweep import SweepConfig

    return SweepConfig(ca.serve_config_from(args, target), args.rates, args.repeats,
                       args.slo_target, args.warmup)


def _sweep(args) -> int:
    from pdserve.bench.sweep import run_sweep
    from pdserve.bench.vocab import resolve_tokenizer

    target = ca.target_from(args)
    args.tokenizer = resolve_tokenizer(args.tokenizer, target)
    line = run_sweep(_sweep_config(args, target))
    return _finish(line, line.pop("failures"), args.max_failed_fraction)


def _compare(args) -> int:
    from pdserve.bench.compare import CompareConfig, run_compare
    from pdserve.bench.stack import StackUnavailable

    split = (lambda s: None if s is None else tuple(shlex.split(s)))
    args.tokenizer = args.tokenizer or args.model  # the stacks serve --model
    cfg = CompareConfig(_sweep_config(args, ca.target_from(args, "http://127.0.0.1:1",
                                                           "127.0.0.1:1")),
                        model=args.model, cores=ca.parse_cores(args.cores),
                        colocated_args=split(args.colocated_args),
                        disagg_args=split(args.disagg_args),
                        common_args=tuple(shlex.split(args.stack_args)),
                        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                        startup_timeout_s=args.startup_timeout)
    try:
        line = run_compare(cfg)
    except StackUnavailable as exc:
        print(f"pdserve bench compare: {exc}", file=sys.stderr, flush=True)
        _emit({"bench": "compare", "error": str(exc).splitlines()[0]})
        return 2
    return _finish(line, line.pop("failures"), args.max_failed_fraction)


def main(argv=None) -> int:
    """`python -m pdserve.bench.cli serve ...` works before the top-level CLI wires it in."""
    parser = argparse.ArgumentParser(prog="pdserve bench")
    add_bench_subcommands(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    raise SystemExit(main())
