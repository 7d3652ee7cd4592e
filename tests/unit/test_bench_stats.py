"""Percentiles and summaries against hand-computed numbers."""

import pytest

from pdserve.bench.stats import median, percentile, summarize


def test_percentile_interpolates_between_ranks():
    xs = [4, 1, 3, 2]  # order must not matter
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 4


def test_percentile_of_one_value_is_that_value():
    assert percentile([7.5], 99) == 7.5


def test_summary_with_an_outlier():
    s = summarize([1, 2, 3, 4, 10])
    assert s.count == 5
    assert s.mean == pytest.approx(4.0)
    assert s.p50 == pytest.approx(3.0)
    assert s.p90 == pytest.approx(7.6)  # rank 3.6: 4 + 0.6 * 6
    assert s.p95 == pytest.approx(8.8)
    assert s.p99 == pytest.approx(9.76)


def test_summary_of_nothing_is_empty_not_an_error():
    s = summarize([])
    assert s.count == 0 and s.p99 is None and s.mean is None
    assert median([]) is None


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
