"""Failure tallies, banners and verdicts; the compare plot's layout (one axis per tier)."""

import pytest

from pdserve.bench.failures import EXIT_TOO_MANY_FAILED, FailureTally, banner, tally, verdict
from pdserve.bench.plots import attainment_axes, plot_attainment


def test_tally_sums_runs_and_keeps_the_commonest_errors():
    t = tally([{"requests": 10, "failed": 2, "errors": {"HTTP 400: bad id": 2}},
               {"requests": 10, "failed": 10, "errors": {"HTTP 400: bad id": 9, "timeout": 1}}])
    assert (t.requests, t.failed) == (20, 12) and t.fraction == pytest.approx(0.6)
    assert t.errors[0] == ("HTTP 400: bad id", 11)
    text = banner(t)
    assert text.startswith("!!! 12 of 20 requests FAILED (60%)") and "x11: HTTP 400" in text


def test_verdict_threshold_and_empty_runs():
    assert banner(FailureTally(5, 0)) == ""
    fields, code = verdict(FailureTally(100, 5), 0.05)
    assert code == 0 and fields["failed"] == 5 and "error" not in fields
    fields, code = verdict(FailureTally(100, 6), 0.05)
    assert code == EXIT_TOO_MANY_FAILED and "6 of 100" in fields["error"]
    assert verdict(FailureTally(0, 0), 0.05)[1] == EXIT_TOO_MANY_FAILED  # nothing measured
    with pytest.raises(ValueError):
        FailureTally(1, 2)


def test_compare_plot_puts_both_modes_on_one_axis_per_tier(tmp_path):
    curves = {"colocated": {"overall": [(1, 1.0), (2, 0.5)], "chat": [(1, 1.0), (2, 0.4)],
                            "batch": [(1, 1.0)]},
              "disagg": {"overall": [(1, 1.0), (2, 0.8)], "chat": [(1, 1.0), (2, 0.9)]}}
    assert attainment_axes(curves) == {"overall": ["colocated", "disagg"],
                                       "batch": ["colocated"],
                                       "chat": ["colocated", "disagg"]}
    png = plot_attainment(curves, tmp_path / "a.png")
    assert png.stat().st_size > 1000
