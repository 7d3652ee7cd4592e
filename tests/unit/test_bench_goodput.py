"""ITL vs TPOT, SLO checks, goodput by tier and the sweep's SLO rate, by hand."""

import pytest

from pdserve.bench.goodput import OVERALL, attainment_by_tier
from pdserve.bench.record import RequestRecord, StreamTrace, inter_token_gaps
from pdserve.bench.slo import TierSLO, meets_slo, parse_slo, request_itl
from pdserve.bench.sweep import max_rate_meeting


def rec(tier="t", ttft=0.1, gaps=(0.05,), error=None, index=0):
    e2e = ttft + sum(gaps)
    return RequestRecord(index, tier, 0.0, e2e, ttft, tuple(gaps), 10, len(gaps) + 1, error)


def test_tpot_is_the_average_gap_after_the_first_token():
    r = rec(ttft=0.1, gaps=[0.05] * 8 + [2.0])  # 10 tokens, e2e 2.5
    assert r.output_tokens == 10
    assert r.tpot_s == pytest.approx((2.5 - 0.1) / 9)  # 0.2667


def test_a_stall_fails_itl_even_when_tpot_meets_its_slo():
    r = rec(gaps=[0.05] * 8 + [2.0])
    assert meets_slo(r, TierSLO("t", tpot_s=0.3))
    assert not meets_slo(r, TierSLO("t", tpot_s=0.3, itl_s=0.5, itl_mode="every"))
    # 9 gaps: p99 sits at rank 7.92, between 0.05 and 2.0 -> 0.05 + 0.92 * 1.95
    assert request_itl(r, "p99") == pytest.approx(1.844)
    assert not meets_slo(r, TierSLO("t", itl_s=0.5, itl_mode="p99"))


def test_p99_itl_forgives_one_stall_in_two_hundred_gaps_but_every_does_not():
    r = rec(gaps=[0.05] * 199 + [2.0])  # p99 rank 197.01 lands among the 0.05s
    assert request_itl(r, "p99") == pytest.approx(0.05)
    assert meets_slo(r, TierSLO("t", itl_s=0.1, itl_mode="p99"))
    assert not meets_slo(r, TierSLO("t", itl_s=0.1, itl_mode="every"))


def test_failed_requests_never_meet_an_slo():
    assert not meets_slo(rec(error="HTTP 500"), TierSLO("t"))


def test_goodput_per_tier_and_overall():
    slos = {"chat": TierSLO("chat", ttft_s=1.0), "batch": TierSLO("batch", tpot_s=0.5)}
    records = [rec("chat", ttft=0.5), rec("chat", ttft=1.5), rec("chat", error="boom"),
               rec("batch", ttft=9.0, gaps=[0.4, 0.4]), rec("batch", ttft=3.0)]
    out = attainment_by_tier(records, slos, duration_s=10.0)
    assert (out["chat"].met, out["chat"].requests) == (1, 3)
    assert out["chat"].attainment == pytest.approx(1 / 3)
    assert out["chat"].goodput_rps == pytest.approx(0.1)
    assert out["batch"].attainment == 1.0 and out["batch"].goodput_rps == pytest.approx(0.2)
    assert out[OVERALL].attainment == pytest.approx(0.6)
    assert out[OVERALL].goodput_rps == pytest.approx(0.3)


def test_the_star_slo_covers_tiers_without_their_own():
    slos = {"*": TierSLO("*", ttft_s=0.2)}
    out = attainment_by_tier([rec("x", ttft=0.1), rec("y", ttft=0.3)], slos, 1.0)
    assert (out["x"].met, out["y"].met) == (1, 0)


def test_parse_slo():
    s = parse_slo("chat:ttft=2,itl=0.5,tpot=0.25,itl_mode=every")
    assert s == TierSLO("chat", ttft_s=2.0, itl_s=0.5, tpot_s=0.25, itl_mode="every")
    with pytest.raises(ValueError):
        parse_slo("chat:latency=2")
    with pytest.raises(ValueError):
        parse_slo("chat:ttft=-1")
    with pytest.raises(ValueError):
        parse_slo("chat:itl_mode=max")


def test_multi_token_chunks_split_their_gap_evenly():
    assert inter_token_gaps([(1.0, 1), (1.5, 1), (2.1, 3)]) == pytest.approx(
        (0.5, 0.2, 0.2, 0.2))


def test_trace_to_record():
    t = StreamTrace(sent_t=0.9)
    for when, n in [(1.0, 1), (1.5, 1), (2.1, 3)]:
        t.add(when, n, "x")
    t.done_t = 2.2
    r = t.to_record(index=3, tier="a", run_start_t=0.4, prompt_tokens=7)
    assert r.ok and r.output_tokens == 5 and r.prompt_tokens == 7
    assert (r.start_s, r.ttft_s, r.e2e_s) == pytest.approx((0.5, 0.1, 1.3))
    assert r.tpot_s == pytest.approx(0.3)  # (1.3 - 0.1) / 4
    empty = StreamTrace(sent_t=0.0)
    empty.done_t = 1.0
    assert empty.to_record(0, "a", 0.0, 1).error == "no tokens received"


def test_slo_rate_interpolates_at_the_first_crossing():
    assert max_rate_meeting([(3, 0.85), (1, 1.0), (2, 0.95)], 0.9) == pytest.approx(2.5)
    assert max_rate_meeting([(1, 1.0), (2, 0.92)], 0.9) == 2
    assert max_rate_meeting([(1, 0.5), (2, 0.95)], 0.9) is None
