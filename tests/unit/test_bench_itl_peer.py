"""bench/itl_peer.py: the batch a served run's median token rode, and the offline step there."""

import json
import subprocess
import sys

import pytest

from pdserve.bench.itl_peer import (engine_step_ratio, median_steps, run_row, step_at,
                                     token_weighted_batch)


def req(start, ttft, gaps, ok=True):
    return {"ok": ok, "start_s": start, "ttft_s": ttft, "itl_s": list(gaps),
            "e2e_s": ttft + sum(gaps)}


def test_token_weighted_batch_counts_requests_decoding_at_each_token():
    # a: first token at 1, tokens at 2..5; b: first token at 2.5, tokens at 3.5, 4.5
    a, b = req(0.0, 1.0, [1.0] * 4), req(2.0, 0.5, [1.0, 1.0])
    # a's tokens at 2, 3, 4, 5 see 1, 2, 2, 1 decoding (b ends at 4.5); b's see 2, 2
    assert token_weighted_batch([a, b]) == 2.0
    assert token_weighted_batch([a]) == 1.0
    failed = dict(req(0.0, 0.1, [0.1] * 9), ok=False)
    assert token_weighted_batch([a, failed]) == 1.0
    assert token_weighted_batch([]) == 0.0


def test_step_is_interpolated_between_timed_batches_and_clamped():
    steps = {8: 40.0, 16: 60.0, 64: 120.0}
    assert step_at(steps, 12) == pytest.approx(50.0)
    assert step_at(steps, 40) == pytest.approx(90.0)
    assert step_at(steps, 2) == 40.0 and step_at(steps, 100) == 120.0
    with pytest.raises(ValueError):
        step_at({}, 8)


def test_cli_prints_each_run_and_the_median_ratio(tmp_path):
    (tmp_path / "off.json").write_text(json.dumps({"decode_step_ms": {"1": 50.0, "4": 80.0},
                                                   "cpu": "Some CPU 9000"}))
    for i, itl in enumerate((0.055, 0.06, 0.1)):
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / "serve.json").write_text(json.dumps({
            "per_request": [req(0.0, 1.0, [1.0] * 3)], "itl_s": {"p50": itl},
            "ttft_s": {"p50": 1.0}, "output_throughput": 10.0, "failed": 0}))
    out = subprocess.run([sys.executable, "-m", "pdserve.bench.itl_peer",
                          str(tmp_path / "off.json")] + [str(tmp_path / f"run{i}")
                                                         for i in range(3)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["batch"] for r in line["runs"]] == [1.0] * 3
    assert line["ratio_median"] == pytest.approx(1.2)  # 60 ms over 50 ms at batch 1
    assert line["cpu"] == "Some CPU 9000"  # the CPU the offline peer ran on
    assert run_row(json.loads((tmp_path / "run2" / "serve.json").read_text()),
                   {1: 50.0})["ratio"] == pytest.approx(2.0)


def test_engine_step_ratio_reads_decode_only_steps_at_their_batch():
    steps = {8: 40.0, 16: 60.0}
    records = [{"tokens": 8, "sampled": 8, "wall_ms": 44.0},  # 1.1x at batch 8
               {"tokens": 16, "sampled": 16, "wall_ms": 90.0},  # 1.5x at batch 16
               {"tokens": 12, "sampled": 12, "wall_ms": 50.0},  # 1.0x at batch 12 (50 ms)
               {"tokens": 300, "sampled": 9, "wall_ms": 900.0},  # carries a prompt: not read
               {"tokens": 0, "sampled": 0, "wall_ms": 1.0}]
    r = engine_step_ratio(records, steps)
    assert r["engine_decode_steps"] == 3
    assert r["engine_decode_ratio_p50"] == pytest.approx(1.1)
    assert r["engine_decode_ratio_p10"] == pytest.approx(1.0)
    assert r["engine_decode_batch_p50"] == 12
    assert engine_step_ratio(records[3:], steps) == {}


def test_cli_prints_the_engine_steps_when_a_trace_lies_beside_the_run(tmp_path):
    (tmp_path / "off.json").write_text(json.dumps({"decode_step_ms": {"1": 50.0, "4": 80.0}}))
    run = tmp_path / "run"
    run.mkdir()
    (run / "serve.json").write_text(json.dumps({
        "per_request": [req(0.0, 1.0, [1.0] * 3)], "itl_s": {"p50": 0.06},
        "ttft_s": {"p50": 1.0}, "output_throughput": 10.0, "failed": 0}))
    (run / "step_trace.jsonl").write_text(
        json.dumps({"tokens": 1, "sampled": 1, "wall_ms": 55.0}) + "\n")
    out = subprocess.run([sys.executable, "-m", "pdserve.bench.itl_peer",
                          str(tmp_path / "off.json"), str(run)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "1.10x the offline step" in out.stdout
    row = json.loads(out.stdout.strip().splitlines()[-1])["runs"][0]
    assert row["engine_decode_ratio_p50"] == pytest.approx(1.1)


def test_several_offline_peers_give_the_median_step_per_batch(tmp_path):
    peers = [{"decode_step_ms": {"8": 40.0, "16": 60.0, "32": 90.0}},
             {"decode_step_ms": {"8": 48.0, "16": 66.0}},
             {"decode_step_ms": {"8": 42.0, "16": 90.0, "64": 1.0}}]
    assert median_steps(peers) == {8: 42.0, 16: 66.0}  # only batches all three timed
    assert median_steps(peers[:2]) == {8: 44.0, 16: 63.0}
    assert median_steps([]) == {}
    for i, p in enumerate(peers[:2]):
        (tmp_path / f"off{i}.json").write_text(json.dumps(p))
    run = tmp_path / "run"
    run.mkdir()
    (run / "serve.json").write_text(json.dumps({
        "per_request": [req(0.0, 1.0, [1.0] * 3), req(0.0, 1.0, [1.0] * 3)],
        "itl_s": {"p50": 0.0528}, "ttft_s": {"p50": 1.0}, "output_throughput": 10.0,
        "failed": 0}))
    out = subprocess.run([sys.executable, "-m", "pdserve.bench.itl_peer",
                          str(tmp_path / "off0.json"), str(run), str(tmp_path / "off1.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["offline_step_ms"] == {"8": 44.0, "16": 63.0}
    assert line["ratio_median"] == pytest.approx(1.2)  # 52.8 ms over 44 ms (batch 2 -> 8)
    none = subprocess.run([sys.executable, "-m", "pdserve.bench.itl_peer", str(run), str(run)],
                          capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "no offline_step JSON" in none.stderr
