"""The `pdserve` command line: one parser, one subcommand per job."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    from pdserve.services.cli_serve import add_subcommands as add_serving

    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serving(sub)  # up, serve
    from pdserve.common.engine.cli import add_generate_subcommand
    add_generate_subcommand(sub)
    bench = sub.add_parser("bench", help="benchmarks; each ends with one JSON line")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from pdserve.bench.offline import add_offline_subcommand
    add_offline_subcommand(bench_sub)
    from pdserve.bench.cli import add_bench_subcommands
    add_bench_subcommands(bench_sub)  # serve, sweep, compare
    from pdserve.bench.kv import add_kv_subcommand
    add_kv_subcommand(bench_sub)
    from pdserve.bench.transport import add_transport_subcommand
    add_transport_subcommand(bench_sub)
    from pdserve.bench.router import add_router_bench_subcommand
    add_router_bench_subcommand(bench_sub)
    from pdserve.bench.sampler import add_sampler_subcommand
    add_sampler_subcommand(bench_sub)
    return parser


def main(argv=None) -> int:
    from pdserve.services.cli_serve import run_parser

    return run_parser(build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
