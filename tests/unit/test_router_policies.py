"""Routing policies, the KV-aware cost, session affinity, the circuit breaker and the
router's prefix memory, driven with fake instances (Candidates)."""

import collections

import pytest

from pdserve.services.router.routing.breaker import CircuitBreaker
from pdserve.services.router.routing.candidate import Candidate, RouteRequest
from pdserve.services.router.routing.cost import kv_cost
from pdserve.services.router.routing.policies import (Affinity, KVAware, LeastLoad, PowerOfTwo,
                                              RoundRobin, make_policy)
from pdserve.services.router.routing.prefix_memory import PrefixMemory
from pdserve.services.router.routing.routing_config import CostWeights, RoutingConfig


def inst(name, active=0, queue=0, usage=0.0, local=0):
    return Candidate(name, name, active, queue, usage, local)


def picks(policy, cands, req=RouteRequest(), n=100):
    return collections.Counter(policy.choose(cands, req).address for _ in range(n))


def test_round_robin_takes_turns():
    cands = [inst("a"), inst("b"), inst("c")]
    rr = RoundRobin()
    assert [rr.choose(cands, RouteRequest()).address for _ in range(6)] == list("abcabc")


def test_least_load_prefers_fewer_active_then_fewer_queued_tokens():
    ll = LeastLoad()
    assert set(picks(ll, [inst("a", 3), inst("b", 1), inst("c", 2)])) == {"b"}
    assert set(picks(ll, [inst("a", 1, 500), inst("b", 1, 20)])) == {"b"}
    assert picks(ll, [inst("a"), inst("b")]) == {"a": 50, "b": 50}  # ties rotate


def test_power_of_two_never_picks_the_worst_and_spreads():
    cands = [inst("a", 0), inst("b", 1), inst("c", 2), inst("d", 9)]
    got = picks(PowerOfTwo(seed=1), cands, n=600)
    assert got["d"] == 0
    assert got["a"] > got["b"] > got["c"] > 0  # a wins every pair it is in


def test_kv_aware_sends_a_cached_prefix_to_its_holder():
    w = CostWeights()
    req = RouteRequest(prompt_len=640, block_size=16, store_blocks=0)
    holder = inst("holder", active=2, queue=0, local=40)  # 640 tokens cached
    others = [inst("idle1"), inst("idle2")]
    assert set(picks(KVAware(w), others + [holder], req)) == {"holder"}
    # its cost counts only the uncached part, and the others pay the whole prompt
    assert kv_cost(holder, req, w) == pytest.approx(w.running * 2)
    assert kv_cost(others[0], req, w) == pytest.approx(640)


def test_kv_aware_leaves_a_holder_that_is_too_busy():
    req = RouteRequest(prompt_len=640, block_size=16)
    busy_holder = inst("holder", active=4, queue=5000, local=40)
    assert set(picks(KVAware(CostWeights()), [busy_holder, inst("idle")], req)) == {"idle"}


def test_kv_aware_leaves_a_holder_far_busier_than_the_least_busy_one():
    req = RouteRequest(prompt_len=640, block_size=16)
    w = CostWeights()  # balance_abs 4, balance_rel 1.5
    # 5 more running than an idle instance: out, though 40 cached blocks save 640 tokens
    assert set(picks(KVAware(w), [inst("holder", active=5, local=40), inst("idle")],
                     req)) == {"idle"}
    # 4 more is within balance_abs, and 9 against 6 within balance_rel: the holder wins
    assert set(picks(KVAware(w), [inst("holder", active=4, local=40), inst("idle")],
                     req)) == {"holder"}
    assert set(picks(KVAware(w), [inst("holder", active=9, local=40), inst("b", active=6)],
                     req)) == {"holder"}
    with pytest.raises(ValueError):
        CostWeights(balance_rel=0.5)


def test_kv_aware_counts_store_blocks_as_partly_free_for_everyone():
    w = CostWeights(store_hit=0.5)
    req = RouteRequest(prompt_len=320, block_size=16, store_blocks=20)
    c = inst("x", local=10)
    # 10 local blocks free, the other 10 stored blocks half free: 320 - 16 * (10 + 5)
    assert kv_cost(c, req, w) == pytest.approx(320 - 16 * 15)


def test_kv_aware_without_geometry_is_least_load():
    req = RouteRequest(prompt_len=100)  # block_size 0: nothing can be matched
    assert set(picks(KVAware(CostWeights()), [inst("a", 3, local=99), inst("b", 0)],
                     req)) == {"b"}


def test_affinity_sticks_per_key_and_yields_when_busy():
    cands = [inst(n) for n in "abcd"]
    pol = Affinity(LeastLoad(), max_queue_tokens=100)
    homes = {k: pol.choose(cands, RouteRequest(affinity=k)).address for k in map(str, range(40))}
    for k, home in homes.items():
        assert set(picks(pol, cands, RouteRequest(affinity=k), n=5)) == {home}
    assert len(set(homes.values())) >= 3  # keys spread over the instances
    home = homes["0"]
    busy = [inst(c.address, queue=1000 if c.address == home else 0) for c in cands]
    assert pol.choose(busy, RouteRequest(affinity="0")).address != home


def test_make_policy_names_and_config_validation():
    assert isinstance(make_policy("kv_aware", RoutingConfig()), KVAware)
    assert isinstance(make_policy("round_robin", RoutingConfig(session_affinity=True)),
                      Affinity)
    with pytest.raises(ValueError):
        RoutingConfig(decode_policy="random")
    with pytest.raises(ValueError):
        CostWeights(store_hit=1.5)
    with pytest.raises(ValueError):
        inst("a", active=-1)


def test_circuit_breaker_opens_half_opens_and_closes():
    now = [0.0]
    br = CircuitBreaker(failures=2, open_s=5.0, clock=lambda: now[0])
    assert br.on_failure() is False and br.allows()
    assert br.on_failure() is True and not br.allows() and br.state == "open"
    now[0] = 6.0
    assert br.state == "half_open" and br.allows()
    br.on_dispatch()
    assert not br.allows()  # one trial at a time
    assert br.on_failure() is True and br.state == "open"  # the trial failed
    now[0] = 12.0
    br.on_dispatch()
    br.on_success()
    assert br.state == "closed" and br.allows()


def test_prefix_memory_counts_leading_blocks_per_instance():
    mem = PrefixMemory(capacity_blocks=100)
    mem.record([b"k1", b"k2", b"k3"], "a")
    mem.record([b"k1", b"k2", b"x3"], "b")
    assert mem.leading([b"k1", b"k2", b"k3", b"k4"]) == {"a": 3, "b": 2}
    mem.forget("a")
    assert mem.leading([b"k1", b"k2", b"k3"]) == {"b": 2}
    small = PrefixMemory(capacity_blocks=2)
    small.record([b"1", b"2", b"3"], "a")
    assert len(small) == 2 and small.leading([b"1"]) == {}  # the oldest went
