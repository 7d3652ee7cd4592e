"""The routing simulation (bench/routing_sim.py): multi-turn chat through the router's real
pool and policies on simulated engines. KV-aware keeps every conversation on its holder and
reaches the ideal hit share; before the load report's extra was fixed at the moment it is
read (Backend.observe), 3-7 of 40 later turns moved to the other instance here."""

import pytest

from pdserve.bench.routing_sim import SimConfig, compare, simulate


def test_kv_aware_keeps_conversations_on_their_holders_and_reaches_the_ideal_hit_share():
    for seed in (1, 2, 3):
        kv = simulate(SimConfig(), "kv_aware", seed)
        assert kv["moves"] == 0, (seed, kv)
        assert kv["prefix_hit_share"] == pytest.approx(kv["ideal_hit_share"], abs=0.005)
        rr = simulate(SimConfig(), "round_robin", seed)
        assert rr["moves"] >= 8 and rr["prefix_hit_share"] < kv["prefix_hit_share"] - 0.1
        assert kv["later_turns"] == rr["later_turns"] == 40


def test_the_comparison_reports_medians_and_the_ratio_over_the_first_policy():
    out = compare(SimConfig(conversations=4, turns=3), ("round_robin", "kv_aware"), (1, 2))
    assert len(out["runs"]) == 4
    ratio = out["ttft_p50_ratio_vs_round_robin"]["kv_aware"]
    med = out["medians"]
    assert ratio == pytest.approx(med["kv_aware"]["ttft_p50_s"] / med["round_robin"]["ttft_p50_s"])


@pytest.mark.parametrize("bad", [dict(turns=0), dict(question=(9, 3)), dict(rate=0.0),
                                 dict(prefill_s=-1.0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SimConfig(**bad)
