"""bench/saturation_peer.py: issue 19's saturation ratios from a serve_saturation.sh folder."""

import json
import subprocess
import sys

import pytest

from pdserve.bench.saturation_peer import summarize


def fill(d, served, offline, profiles=None):
    """served / offline: {temp: [tok/s per run]}; profiles: {temp: [dict per run]}."""
    for t, vals in served.items():
        for i, v in enumerate(vals, 1):
            (d / f"served-t{t}-{i}.json").write_text(json.dumps(
                {"bench": "serve", "output_throughput": v, "failed": 0}))
    for t, vals in offline.items():
        for i, v in enumerate(vals, 1):
            (d / f"offline-t{t}-{i}.json").write_text(json.dumps({"pdserve_output_tok_s": v}))
    for t, rows in (profiles or {}).items():
        for i, r in enumerate(rows, 1):
            (d / f"profile-t{t}-{i}.json").write_text(json.dumps(r))


def test_ratios_are_of_medians(tmp_path):
    fill(tmp_path, {"1.0": [300.0, 340.0, 330.0], "0.0": [350.0, 360.0, 340.0]},
         {"0.0": [400.0, 350.0, 360.0], "1.0": [360.0, 340.0, 380.0]},
         {"1.0": [{"sample_ms": 1.2, "engine_step_ms": 100.0},
                  {"sample_ms": 1.4, "engine_step_ms": 90.0}],
          "0.0": [{"sample_ms": 0.7}]})
    s = summarize(tmp_path)
    assert s["median_tok_s"] == {"served_t1.0": 330.0, "served_t0.0": 350.0,
                                 "offline_t1.0": 360.0, "offline_t0.0": 360.0}
    assert s["served_t1_over_offline_greedy"] == pytest.approx(330 / 360, abs=1e-3)
    assert s["served_t1_over_served_greedy"] == pytest.approx(330 / 350, abs=1e-3)
    assert s["offline_t1_over_offline_greedy"] == 1.0
    assert s["profile"] == {"t1.0": {"engine_step_ms": 95.0, "sample_ms": 1.3},
                            "t0.0": {"sample_ms": 0.7}}


def test_a_missing_cell_a_failed_run_or_a_broken_line_is_refused(tmp_path):
    fill(tmp_path, {"1.0": [300.0], "0.0": [350.0]}, {"0.0": [360.0]})
    with pytest.raises(ValueError, match="no offline run at temperature 1.0"):
        summarize(tmp_path)
    fill(tmp_path, {}, {"1.0": [360.0]})
    (tmp_path / "served-t0.0-2.json").write_text(json.dumps(
        {"output_throughput": 999.0, "failed": 3}))
    with pytest.raises(ValueError, match="failed requests"):
        summarize(tmp_path)
    (tmp_path / "served-t0.0-2.json").write_text("Traceback (most recent call last):")
    with pytest.raises(ValueError, match="no JSON line"):
        summarize(tmp_path)


def test_cli_ends_with_one_json_line(tmp_path):
    fill(tmp_path, {"1.0": [340.0, 350.0], "0.0": [350.0, 350.0]},
         {"0.0": [360.0, 360.0], "1.0": [355.0, 365.0]})
    out = subprocess.run([sys.executable, "-m", "pdserve.bench.saturation_peer",
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["bench"] == "serve_saturation"
    assert line["served_t1_over_offline_greedy"] == pytest.approx(345 / 360, abs=1e-3)
    assert "served_t1_over_offline_greedy 0.958" in out.stdout
