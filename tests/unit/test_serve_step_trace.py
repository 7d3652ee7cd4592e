"""Served step records from polled StepProfile snapshots (bench/serve_step_trace.py)."""

import pytest

from pdserve.bench.serve_step_trace import (StepRecord, collect, step_record, summarize,
                                            weighted_median)
from pdserve.common.engine.step_profile import StepProfile


def _step(p: StepProfile, tokens: int, sampled: int, ms: int) -> None:
    # schedule 1 ms, forward ms - 3, sample 1, update 1 (stamps in ns)
    t = [0, 1, ms - 2, ms - 1, ms]
    p.add_step(tokens, sampled, *(x * 1_000_000 for x in t))


def test_one_step_between_polls_is_a_record_and_publish_counts():
    p = StepProfile()
    before = p.snapshot()
    _step(p, 300, 33, 400)
    p.publish_ns += 2_000_000
    rec = step_record(before, p.snapshot())
    assert rec == StepRecord(300, 33, 402.0)
    assert not rec.decode_only
    mid = p.snapshot()
    _step(p, 32, 32, 90)
    assert step_record(mid, p.snapshot()).decode_only


def test_zero_or_several_steps_give_no_record():
    p = StepProfile()
    s0 = p.snapshot()
    assert step_record(s0, p.snapshot()) is None
    _step(p, 8, 8, 10)
    _step(p, 8, 8, 10)
    assert step_record(s0, p.snapshot()) is None


def test_weighted_median_repeats_values_by_weight():
    assert weighted_median([(10.0, 1), (100.0, 3)]) == 100.0
    assert weighted_median([(10.0, 3), (100.0, 1)]) == 10.0
    assert weighted_median([(5.0, 2), (7.0, 2)]) == 5.0
    with pytest.raises(ValueError):
        weighted_median([(1.0, 0)])


def test_summary_splits_prompt_steps_and_weights_itl_by_tokens():
    # 6 decode-only steps at batch 4 (50 ms), 1 at batch 60 (150 ms),
    # 2 prompt steps with 60 decodes + 256 prompt tokens (500 ms)
    recs = [StepRecord(4, 4, 50.0)] * 6 + [StepRecord(60, 60, 150.0)] \
        + [StepRecord(60 + 256, 61, 500.0)] * 2
    s = summarize(recs, bin_width=8)
    assert (s["records"], s["decode_only_steps"], s["prompt_steps"]) == (9, 7, 2)
    assert s["decode_step_p50_ms"] == 50.0 and s["prompt_step_p50_ms"] == 500.0
    assert s["prompt_tokens_per_prompt_step"] == 255.0
    # tokens: 24 in 50 ms steps, 60 in the 150 ms one, 122 in prompt steps (of 206)
    assert s["engine_itl_p50_ms"] == 500.0
    assert s["token_share_of_prompt_steps"] == round(122 / 206, 4)
    assert s["token_weighted_median_batch"] == 61  # the batch a token sees, not the mean
    assert s["mean_batch"] == round(206 / 9, 2)
    assert s["decode_step_ms_by_batch"] == {"0-7": {"steps": 6, "p50_ms": 50.0},
                                            "56-63": {"steps": 1, "p50_ms": 150.0}}


def test_no_records_is_an_error():
    with pytest.raises(ValueError, match="no single step"):
        summarize([])


def test_collect_keeps_only_single_step_polls():
    p = StepProfile()
    script = iter([lambda: None, lambda: _step(p, 8, 8, 10),
                   lambda: (_step(p, 9, 9, 10), _step(p, 9, 9, 10)), lambda: _step(p, 300, 9, 50)])

    def snap():
        next(script, lambda: None)()
        return p.snapshot()

    recs = collect(snap, duration_s=0.05, poll_s=0.005)
    assert [r.tokens for r in recs] == [8, 300]


def test_offline_step_beside_load_parses_busy_over_period():
    from pdserve.bench.offline_step import parse_beside_load

    assert parse_beside_load("3/15") == (0.003, 0.015)
    for bad in ("3", "0/15", "20/15", "a/b"):
        with pytest.raises(ValueError, match="beside-load"):
            parse_beside_load(bad)


def test_offline_step_context_spread_spans_the_served_contexts():
    from pdserve.bench.offline_step import prompt_len

    lens = [prompt_len(256, 128, i, 16) for i in range(16)]
    assert lens[0] == 256 and lens[-1] == 376 and lens == sorted(set(lens))
    assert [prompt_len(256, 0, i, 4) for i in range(4)] == [256] * 4
