"""The `pdserve` command line: one parser, one subcommand per job.

`--help` must stay fast (well under a second): the modules that add subcommands import nothing
heavy (torch, matplotlib, transformers) at module level; their commands import what they need
when they run. tests/unit/test_cli_help.py holds every subcommand to that and to a help text
per option.
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default (argparse's formatter skips options without
    help text; every option here has one, a test says so)."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subparsers (add_subparsers uses the parser's own class) all
    format help with HelpFormatter: the one place that choice is made."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from pdserve.services.cli_serve import add_subcommands as add_serving

    from pdserve.services.common.arg_files import PREFIX

    # `--flag @FILE`: the value comes from FILE (secrets; services/common/arg_files.py)
    parser = Parser(prog="pdserve", fromfile_prefix_chars=PREFIX,
                    description="LLM serving with prefill and decode split into services.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serving(sub)  # up, serve
    from pdserve.common.engine.cli import add_generate_subcommand
    add_generate_subcommand(sub)
    from pdserve.services.cli_certs import add_certs_subcommand
    add_certs_subcommand(sub)
    bench = sub.add_parser("bench", help="benchmarks; each ends with one JSON line")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from pdserve.bench.offline import add_offline_subcommand
    add_offline_subcommand(bench_sub)
    from pdserve.bench.cli import add_bench_subcommands
    add_bench_subcommands(bench_sub)  # serve, sweep, compare
    from pdserve.bench.kv import add_kv_subcommand
    add_kv_subcommand(bench_sub)
    from pdserve.bench.multiturn import add_multiturn_subcommand
    add_multiturn_subcommand(bench_sub)
    from pdserve.bench.transport import add_transport_subcommand
    add_transport_subcommand(bench_sub)
    from pdserve.bench.router import add_router_bench_subcommand
    add_router_bench_subcommand(bench_sub)
    from pdserve.bench.sampler_args import add_sampler_subcommand
    add_sampler_subcommand(bench_sub)
    return parser


def main(argv=None) -> int:
    from pdserve.services.cli_serve import run_parser

    return run_parser(build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
