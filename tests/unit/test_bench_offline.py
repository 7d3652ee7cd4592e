"""`pdserve bench offline` end to end on the tiny model: the JSON line carries the figures the
issue names, both GEMMs' rates, and ceilings consistent with them."""

import json
import subprocess
import sys


def test_bench_offline_tiny_prints_one_json_line_with_ratios():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "offline", "--model", "tiny",
         "--num-prompts", "3", "--input-len", "24", "--output-len", "5", "--num-threads", "1",
         "--max-num-batched-tokens", "64"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("pdserve_output_tok_s", "hf_output_tok_s", "ratio", "ceiling_fraction",
                "ceiling_fraction_torch_matmul"):
        assert res[key] > 0, key
    assert res["ratio"] == res["hf_s"] / res["pdserve_s"]
    rates = res["matmul_gflops"]
    assert set(rates["prefill"]) == {"torch", "onednn"} == set(rates["decode"])
    # the ceiling takes the faster GEMM, so it is never looser than torch's alone
    assert res["matmul_gflops_prefill"] == max(rates["prefill"].values())
    assert res["ceiling_output_tok_s"] >= res["ceiling_torch_matmul_output_tok_s"]
    assert res["ceiling_fraction"] <= res["ceiling_fraction_torch_matmul"]
