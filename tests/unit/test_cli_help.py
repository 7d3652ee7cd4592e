"""`pdserve --help` and every subcommand's `--help`: fast (no torch, matplotlib or transformers
imported to build the parser), every option has a help text and shows its default."""

import argparse
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "matplotlib", "transformers")
# Subcommands whose options are all described: the services (serve *, up) and the benches
# users run most. The others (generate, bench offline/kv/transport) still have options
# without help; extend this set as they get it.
SERVICES = {("up",), ("serve",), ("serve", "router"), ("serve", "decode"), ("serve", "prefill"),
            ("serve", "kvstore"), ("serve", "kvstore-master"), ("serve", "kvstore-node")}
DESCRIBED = {(), ("bench",), ("bench", "serve"), ("bench", "sweep"), ("bench", "compare"),
             ("bench", "router")} | SERVICES


def subcommand_paths(parser, prefix=()):
    """Every (sub)command's argv prefix and its parser, the root included."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommand_paths(sub, prefix + (name,))


@pytest.fixture(scope="module")
def parser():
    from pdserve.cli import build_parser

    return build_parser()


def test_building_the_parser_imports_nothing_heavy():
    code = ("import sys, json; from pdserve.cli import build_parser; build_parser(); "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_option_has_help_and_the_formatter_shows_defaults(parser):
    from pdserve.cli import HelpFormatter

    missing = []
    for path, p in subcommand_paths(parser):
        assert p.formatter_class is HelpFormatter, path
        if path not in DESCRIBED:
            continue
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(" ".join(path + (action.option_strings[0]
                                                 if action.option_strings else action.dest,)))
    assert not missing, "options without help text:\n" + "\n".join(missing)
    assert SERVICES <= {path for path, _ in subcommand_paths(parser)}  # no name drifted


def test_help_of_every_subcommand_prints_defaults(parser, capsys):
    paths = [path for path, _ in subcommand_paths(parser)]
    assert ("bench", "offline") in paths and ("serve", "router") in paths
    for path in paths:
        with pytest.raises(SystemExit) as info:
            parser.parse_args([*path, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: pdserve")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "requests in all (default: 100)" in out  # --num-prompts
    assert "(default: 127.0.0.1:50050)" in out  # --grpc-addr: the router's gRPC port


def test_the_help_command_runs_in_a_fresh_process_without_heavy_imports():
    """What a user types: the console script's module, run in a fresh interpreter."""
    code = ("import sys, json\nfrom pdserve.cli import main\n"
            "try:\n    main(['bench', 'serve', '--help'])\nexcept SystemExit:\n    pass\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("usage: pdserve bench serve")
    assert json.loads(lines[-1]) == []
