"""bench/vllm_reference_report.py: per-server medians and within-round ratios to vLLM."""

import json

import pytest

from pdserve.bench.vllm_reference_report import KEYS, collect, main, summarize


def _write(out, name, tok_s, itl_ms, ttft_ms=1000.0):
    row = dict.fromkeys(KEYS, ttft_ms)
    row.update(output_throughput=tok_s, median_itl_ms=itl_ms)
    (out / name).write_text(json.dumps({**row, "date": "20261207"}))


def test_sequential_hold_gives_one_round(tmp_path):
    for rate in ("2", "inf"):
        _write(tmp_path, f"vllm-r{rate}.json", 80.0, 400.0)
        _write(tmp_path, f"fp32-r{rate}.json", 100.0, 300.0)
    s = summarize(tmp_path, ["fp32"])
    assert s["rounds"] == 1
    assert s["over_vllm"]["fp32"]["inf"]["throughput"] == 1.25
    assert s["over_vllm"]["fp32"]["2"]["itl_p50"] == 0.75


def test_ratios_are_paired_within_rounds(tmp_path):
    # the VM slows down from round 1 to round 3; each round's ratio is 1.2, while a ratio of
    # the two sides' medians would mix rounds (100 / 80 = 1.25)
    for k, (v, p) in enumerate([(100.0, 120.0), (80.0, 96.0), (50.0, 60.0)], start=1):
        for rate in ("2", "inf"):
            _write(tmp_path, f"vllm-r{rate}-k{k}.json", v, 400.0)
            _write(tmp_path, f"fp32-r{rate}-k{k}.json", p, 320.0)
    s = summarize(tmp_path, ["fp32"])
    assert s["rounds"] == 3
    r = s["over_vllm"]["fp32"]["2"]
    assert r["throughput"] == 1.2 and r["throughput_rounds"] == [1.2, 1.2, 1.2]
    assert r["itl_p50"] == 0.8
    assert s["runs"]["vllm-rinf"]["output_throughput"] == 80.0


def test_a_missing_round_is_refused(tmp_path):
    for k in (1, 2):
        for rate in ("2", "inf"):
            _write(tmp_path, f"vllm-r{rate}-k{k}.json", 80.0, 400.0)
    for rate in ("2", "inf"):
        _write(tmp_path, f"fp32-r{rate}-k1.json", 100.0, 300.0)
    with pytest.raises(ValueError, match="rounds"):
        collect(tmp_path, ["vllm", "fp32"])


def test_a_failed_client_run_is_refused(tmp_path):
    for rate in ("2", "inf"):
        _write(tmp_path, f"vllm-r{rate}.json", 80.0, 400.0)
    (tmp_path / "fp32-r2.json").write_text(json.dumps({"output_throughput": 1.0}))
    _write(tmp_path, "fp32-rinf.json", 100.0, 300.0)
    with pytest.raises(ValueError, match="median_itl_ms"):
        summarize(tmp_path, ["fp32"])


def test_main_ends_with_one_json_line(tmp_path, capsys):
    for rate in ("2", "inf"):
        _write(tmp_path, f"vllm-r{rate}.json", 80.0, 400.0)
        _write(tmp_path, f"a-b.c-r{rate}.json", 88.0, 400.0)
    assert main([str(tmp_path), "a-b.c"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["bench"] == "vllm_reference"
    assert last["over_vllm"]["a-b.c"]["2"]["throughput"] == 1.1
