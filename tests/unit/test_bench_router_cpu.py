"""`python -m pdserve.bench.serve_router_cpu` streams through a real router over a fake
instance and reports the router's CPU per token in one JSON line."""

import json
import subprocess
import sys


def test_router_cpu_bench_counts_every_token_of_both_endpoints():
    for extra in ([], ["--chat"]):
        out = subprocess.run([sys.executable, "-m", "pdserve.bench.serve_router_cpu",
                              "--streams", "3", "--tokens", "5", "--rounds", "2", *extra],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["endpoint"] == ("chat" if extra else "completions")
        for r in res["rounds"]:
            # every token but each stream's last (it carries the finish reason) is a text
            # event; chat adds one role event per stream
            assert r["tokens"] == 15 and r["events"] == (15 if extra else 12)
            assert r["router_cpu_s"] >= 0
        per = sorted(r["cpu_ms_per_token"] for r in res["rounds"])
        assert res["cpu_ms_per_token"] == (per[0] + per[1]) / 2  # the median of two


def test_router_cpu_bench_through_the_bench_client_counts_every_token():
    out = subprocess.run([sys.executable, "-m", "pdserve.bench.serve_router_cpu",
                          "--streams", "3", "--tokens", "5", "--rounds", "2", "--bench-client"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["client"] == "bench" and res["client_cpu_ms_per_token"] >= 0
    # the bench client counts a token per chunk, the last (with its finish reason) included
    assert [r["events"] for r in res["rounds"]] == [15, 15]
