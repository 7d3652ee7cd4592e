"""`pdserve bench routing`: run order, medians and ratios, and what it reads off a stack."""

import pytest

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.routing_ab import RoutingABConfig, run_order, summarize
from pdserve.bench.routing_probe import metrics_port, prefix_hits, routed_counts
from pdserve.bench.serve import ServeConfig
from pdserve.bench.target import TargetConfig
from pdserve.bench.workload_config import WorkloadConfig


def _serve() -> ServeConfig:
    return ServeConfig(TargetConfig(base_url="http://127.0.0.1:1"),
                       WorkloadConfig(kind="chat"), ArrivalConfig(rate=1.0))


def test_order_alternates_per_seed_so_drift_favours_neither():
    pols = ("kv_aware", "round_robin")
    assert [run_order(pols, i) for i in range(3)] == [pols, pols[::-1], pols]


def test_medians_over_seeds_and_the_ratio_over_the_first_policy():
    runs = [{"policy": p, "ttft_p50_s": t, "ttft_p99_s": 2 * t, "itl_p50_s": 0.1,
             "request_throughput": 1.0, "prefix_hit_share": h,
             "ttft_later_turns_p50_s": None if p == "round_robin" else t / 2}
            for p, t, h in (("kv_aware", 0.2, 0.9), ("kv_aware", 0.4, 0.8),
                            ("kv_aware", 0.3, None), ("round_robin", 1.0, 0.4),
                            ("round_robin", 0.5, 0.5), ("round_robin", 0.6, 0.3))]
    out = summarize(runs, ("round_robin", "kv_aware"))
    assert out["medians"]["kv_aware"]["ttft_p50_s"] == pytest.approx(0.3)
    assert out["medians"]["kv_aware"]["prefix_hit_share"] == pytest.approx(0.85)  # None left out
    assert out["medians"]["round_robin"]["ttft_p50_s_by_seed"] == [1.0, 0.5, 0.6]
    assert out["ttft_p50_ratio_vs_round_robin"]["kv_aware"] == pytest.approx(0.3 / 0.6)
    assert out["ttft_later_turns_p50_ratio_vs_round_robin"]["kv_aware"] is None  # no base


def test_stack_spec_sets_the_router_policy_and_replicas():
    cfg = RoutingABConfig(_serve(), ("kv_aware", "round_robin"), replicas=3,
                          stack_args=("--max-model-len", "4096"))
    args = cfg.spec("round_robin").extra_args
    assert args[:4] == ("--replicas", "3", "--num-threads", "1")
    assert "--router-arg=--decode-policy" in args and "--router-arg=round_robin" in args
    assert args[-2:] == ("--max-model-len", "4096")
    for bad in (dict(policies=("kv_aware",)), dict(policies=("kv_aware", "nope")),
                dict(replicas=1), dict(seeds=()), dict(stack_per="never")):
        with pytest.raises(ValueError):
            RoutingABConfig(_serve(), **{"policies": ("kv_aware", "round_robin"), **bad})


def test_router_and_engine_counters_are_read_from_prometheus_text():
    router = ('pdserve_router_routed_total{kind="decode",instance="127.0.0.1:5"} 7.0\n'
              'pdserve_router_routed_total{kind="prefill",instance="127.0.0.1:6"} 2.0\n'
              'pdserve_router_routed_created{kind="decode",instance="127.0.0.1:5"} 1.7e9\n')
    assert routed_counts(router) == {"127.0.0.1:5": 7}
    engines = ['vllm:prefix_cache_queries_total{model_name="m"} 400.0\n'
               'vllm:prefix_cache_hits_total{model_name="m"} 100.0\n',
               'vllm:prefix_cache_queries_total 100.0\nvllm:prefix_cache_hits_total 50.0\n']
    assert prefix_hits(engines) == (150.0, 500.0)
    assert metrics_port(["python", "--port", "1", "--metrics-port", "9100"]) == 9100
    assert metrics_port(["python", "--metrics-port"]) == 0
