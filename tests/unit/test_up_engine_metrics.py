"""`pdserve up` turns every engine's metrics port on (its vllm: series) at a free port."""

from pdserve.cli import build_parser
from pdserve.services.cli_serve import engine_argv


def test_every_engine_gets_a_metrics_port():
    args = build_parser().parse_args(["up", "--model", "tiny"])
    argv = engine_argv(args, cpus="0", threads=1)
    assert argv.count("--metrics-port") == 1
    assert 0 < int(argv[argv.index("--metrics-port") + 1]) < 65536
