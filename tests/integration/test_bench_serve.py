"""A short bench run against a real colocated stack (tiny model), started with `pdserve up`."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.lengths import LengthDist
from pdserve.bench.serve import ServeConfig
from pdserve.bench.slo import TierSLO
from pdserve.bench.stack import StackSpec, running_stack
from pdserve.bench.sweep import SweepConfig, run_sweep
from pdserve.bench.target import TargetConfig
from pdserve.bench.workload_config import WorkloadConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_UP = ("--num-threads", "1", "--max-model-len", "512", "--num-blocks", "256")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    spec = StackSpec("colocated", "tiny", TINY_UP, startup_timeout_s=120)
    with running_stack(spec, tmp_path_factory.mktemp("up")) as s:
        yield s


def test_bench_serve_cli_writes_result_table_and_plots(stack, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there", "tier": "interactive"}\n'
                       '{"prompt_ids": [5, 6, 7, 8], "tier": "batch", "max_tokens": 6}\n')
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.cli", "serve", "--base-url", stack.http_url,
         "--tokenizer", "tiny", "--workload", "jsonl", "--dataset-path", str(prompts),
         "--num-prompts", "6", "--output-len", "4", "--rate", "20", "--seed", "1",
         "--slo", "interactive:ttft=30,itl=30", "--slo", "batch:tpot=30",
         "--out-dir", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["bench"] == "serve" and line["requests"] == 6 and line["failed"] == 0
    assert "interactive" in proc.stdout and "ttft p99" in proc.stdout  # the printed table

    result = json.loads((out / "serve.json").read_text())
    for key in ("config", "duration_s", "request_throughput", "output_throughput",
                "total_token_throughput", "goodput_rps", "attainment", "ttft_s", "itl_s",
                "tpot_s", "e2e_s", "tiers", "per_request"):
        assert key in result, key
    assert set(result["tiers"]) == {"interactive", "batch"}
    assert result["attainment"] == 1.0  # generous SLOs
    batch = [r for r in result["per_request"] if r["tier"] == "batch"]
    assert [r["output_tokens"] for r in batch] == [6] * 3  # max_tokens from the file, ignore_eos
    assert all(len(r["itl_s"]) == 5 for r in batch)  # one gap per token after the first
    assert result["tiers"]["batch"]["slo"]["tpot_s"] == 30
    assert (out / "serve_cdf.png").read_bytes()[:8] == PNG_MAGIC


def test_sweep_over_grpc_draws_the_attainment_curve(stack, tmp_path):
    serve = ServeConfig(
        target=TargetConfig(api="grpc", grpc_addr=stack.grpc_addr, tls_dir=stack.tls_dir),
        workload=WorkloadConfig(num_prompts=4, input_len=LengthDist("fixed", 16),
                                output_len=LengthDist("fixed", 4)),
        arrivals=ArrivalConfig("poisson"), slos=(TierSLO("*", ttft_s=1e-6),),
        tokenizer="tiny", out_dir=str(tmp_path), progress=False)
    line = run_sweep(SweepConfig(serve, rates=(5.0, 50.0)))
    # An impossible TTFT bound: nothing meets it, so no rate reaches 90%.
    assert [tuple(p) for p in line["curves"]["random"]] == [(5.0, 0.0), (50.0, 0.0)]
    assert line["max_rate"]["random"] is None
    assert (tmp_path / "sweep_attainment.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads((tmp_path / "sweep.json").read_text())["rates"] == [5.0, 50.0]
    ok = run_sweep(SweepConfig(replace(serve, slos=()), rates=(5.0,)), stem="ok")
    assert ok["max_rate"]["overall"] == 5.0


def test_compare_refuses_clearly_when_up_rejects_the_options():
    from pdserve.bench.stack import StackUnavailable, check_up_accepts

    with pytest.raises(StackUnavailable, match="no-such-option"):
        check_up_accepts(StackSpec("colocated", "tiny", ("--no-such-option",)))
    check_up_accepts(StackSpec("colocated", "tiny", TINY_UP))  # accepted: no error
