"""`pdserve bench offline` end to end on the tiny model: the JSON line carries the figures the
issue names, both GEMMs' rates, and ceilings consistent with them."""

import json
import subprocess
import sys

import pytest


def test_bench_offline_tiny_prints_one_json_line_with_ratios():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "offline", "--model", "tiny",
         "--num-prompts", "3", "--input-len", "24", "--output-len", "5", "--num-threads", "1",
         "--max-num-batched-tokens", "64"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("pdserve_output_tok_s", "hf_output_tok_s", "ratio", "ceiling_fraction",
                "ceiling_fraction_fastest_gemm"):
        assert res[key] > 0, key
    assert res["ratio"] == res["hf_s"] / res["pdserve_s"]
    rates = res["matmul_gflops"]
    assert set(rates["prefill"]) == {"torch", "onednn"} == set(rates["decode"])
    # the ceiling is torch's matmul; the stricter one takes the faster GEMM, so it is
    # never looser
    assert res["matmul_gflops_prefill"] == rates["prefill"]["torch"]
    assert res["matmul_gflops_decode"] == rates["decode"]["torch"]
    for phase in ("prefill", "decode"):
        assert rates[phase][res["fastest_gemm"][phase]] == max(rates[phase].values())
    assert res["ceiling_fastest_gemm_output_tok_s"] >= res["ceiling_output_tok_s"]
    assert res["ceiling_fraction_fastest_gemm"] <= res["ceiling_fraction"]
    # ideal time (fraction x our time) x ceiling rate = the output tokens (3 prompts x 5)
    assert res["ceiling_fraction"] * res["pdserve_s"] * res["ceiling_output_tok_s"] == \
        pytest.approx(3 * 5)
    # --weights both (default): both engines timed, ratio and footprints reported; the tiny
    # model has no quantized matrix, so both hold the same fp32 weights and KV blocks
    assert res["weights"] == ["packed", "fp32"] and res["cpu"]
    by = res["by_weights"]
    assert res["packed_vs_fp32"] == by["fp32"]["s"] / by["packed"]["s"]
    assert res["pdserve_s"] == by["packed"]["s"]
    assert by["packed"]["weights_resident_mib"] == by["fp32"]["weights_resident_mib"] > 0
    assert by["packed"]["kv_blocks_for_budget"] == by["fp32"]["kv_blocks_for_budget"] > 0


def test_batch1_decode_split_subtracts_each_repeats_prefill():
    """--batch1's decode steps alone: per repeat, the full time less the one-token time, then
    the median (not the difference of the medians), over prompts x (output_len - 1) steps."""
    from pdserve.bench.offline import decode_split
    res = decode_split([10.0, 12.0, 11.0], [2.0, 5.0, 2.5], n_prompts=4, output_len=128)
    assert res["decode_s"] == 8.0  # median of 8.0, 7.0, 8.5
    assert res["prefill_s"] == 2.5
    assert res["decode_tok_s"] == 4 * 127 / 8.0


def test_cpu_name_tells_the_family_and_isa_of_the_first_cpu(tmp_path):
    from pdserve.bench.offline import cpu_name

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
                    "flags\t\t: fpu sse2 avx2 avx512f\n\nprocessor\t: 1\ncpu family\t: 25\n"
                    "model\t\t: 1\nmodel name\t: Other\nflags\t\t: avx2\n")
    assert cpu_name(str(info)) == "AMD EPYC (family 26 model 2, avx512)"
    info.write_text("model name\t: Some Xeon\nflags\t\t: sse2 avx2\n")
    assert cpu_name(str(info)) == "Some Xeon (avx2)"
    assert cpu_name(str(tmp_path / "missing"))  # platform's answer, never empty


def test_batch1_with_half_kv_reports_both_decode_rates():
    """--batch1 with a half KV cache times the fp32-KV engine beside it: the JSON line has
    the decode-alone rate of each (llama.cpp's own KV is fp16, pdserve's CPU default fp32)."""
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "offline", "--model", "tiny", "--batch1",
         "--num-prompts", "2", "--input-len", "12", "--output-len", "32", "--num-threads", "1",
         "--repeats", "3", "--skip-hf", "--weights", "fp32", "--kv-cache-dtype", "float16"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["kv_cache_dtype"] == "float16"
    assert res["decode_tok_s"] > 0 and res["fp32_kv_decode_tok_s"] > 0
    assert "batch 1, fp32 KV: decode steps alone" in out.stdout
