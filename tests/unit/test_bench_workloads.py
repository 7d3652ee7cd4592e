"""Length distributions, arrival schedules and the synthetic and JSONL workloads."""

import json
from dataclasses import replace

import numpy as np
import pytest

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.lengths import LengthDist
from pdserve.bench.workload import build_requests
from pdserve.bench.workload_config import WorkloadConfig
from pdserve.common.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.tiny()


def test_length_specs():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("12").sample(rng, 3) == [12, 12, 12]
    u = LengthDist.parse("uniform:2:4").sample(rng, 300)
    assert set(u) == {2, 3, 4}
    assert LengthDist.parse("normal:5:0").sample(rng, 4) == [5] * 4
    assert min(LengthDist.parse("exponential:1").sample(rng, 500)) >= 1
    for bad in ("uniform:5:2", "normal:5", "zipf:3", "0"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_constant_and_all_at_once_schedules():
    rng = np.random.default_rng(0)
    assert ArrivalConfig("constant", rate=4).offsets(4, rng) == pytest.approx([0, .25, .5, .75])
    assert ArrivalConfig("poisson").offsets(3, rng) == [0.0, 0.0, 0.0]
    assert ArrivalConfig("concurrency", concurrency=2).offsets(3, rng) is None


def test_poisson_and_gamma_keep_the_rate_and_gamma_is_burstier():
    n = 20_000
    gaps = {}
    for kind, b in (("poisson", 1.0), ("gamma", 0.25)):
        t = ArrivalConfig(kind, rate=5.0, burstiness=b).offsets(n, np.random.default_rng(1))
        gaps[kind] = np.diff(t)
        assert gaps[kind].mean() == pytest.approx(0.2, rel=0.05)
    cv = {k: g.std() / g.mean() for k, g in gaps.items()}
    assert cv["poisson"] == pytest.approx(1.0, abs=0.05)  # exponential gaps
    assert cv["gamma"] == pytest.approx(2.0, abs=0.15)  # 1 / sqrt(shape)


def test_a_seed_repeats_the_schedule():
    a = ArrivalConfig("gamma", 3.0, 0.5)
    assert a.offsets(50, np.random.default_rng(7)) == a.offsets(50, np.random.default_rng(7))


def test_arrival_config_validates():
    for kw in ({"kind": "uniform"}, {"rate": 0}, {"burstiness": 0},
               {"kind": "concurrency", "concurrency": 0}):
        with pytest.raises(ValueError):
            ArrivalConfig(**kw)


def test_random_workload_has_exact_lengths_and_is_repeatable(tok):
    cfg = WorkloadConfig(num_prompts=5, input_len=LengthDist.parse("uniform:3:9"),
                         output_len=LengthDist("fixed", 4), seed=3)
    reqs = build_requests(cfg, tok)
    assert [len(r.prompt_ids) for r in reqs] == [r.prompt_len for r in reqs]
    assert all(3 <= r.prompt_len <= 9 and r.max_tokens == 4 for r in reqs)
    assert all(i < 317 for r in reqs for i in r.prompt_ids)  # no special tokens
    assert build_requests(cfg, tok) == reqs


def test_prefix_workload_shares_prefixes_round_robin(tok):
    cfg = WorkloadConfig(kind="prefix", num_prompts=6, num_prefixes=2,
                         prefix_len=LengthDist("fixed", 10), input_len=LengthDist("fixed", 3))
    reqs = build_requests(cfg, tok)
    heads = [r.prompt_ids[:10] for r in reqs]
    assert heads[0] == heads[2] == heads[4] != heads[1] == heads[3] == heads[5]
    assert all(len(r.prompt_ids) == 13 for r in reqs)
    assert len({r.prompt_ids for r in reqs}) == 6  # every suffix differs


def test_chat_workload_orders_turns_across_conversations(tok):
    cfg = WorkloadConfig(kind="chat", num_prompts=5, turns=2)  # 3 conversations, cut to 5
    reqs = build_requests(cfg, tok)
    assert [r.turn for r in reqs] == [0, 0, 0, 1, 1]  # every first turn before any second
    assert sorted(r.conversation for r in reqs[:3]) == [0, 1, 2]
    assert len({r.conversation for r in reqs[3:]}) == 2
    assert all(r.is_chat and r.messages[0][0] == "user" for r in reqs)
    assert [(r.conversation, r.turn) for r in build_requests(cfg, tok)] == \
        [(r.conversation, r.turn) for r in reqs]  # the order is the seed's


def test_chat_turn_orders_vary_so_round_robin_is_not_sticky_by_accident(tok):
    """In one fixed order, round-robin over 2 instances sends conversation c to instance
    c % 2 every turn (8 conversations); in the workload's order it does not."""
    cfg = WorkloadConfig(kind="chat", num_prompts=8 * 6, turns=6,
                         input_len=LengthDist("fixed", 4), seed=1)
    reqs = build_requests(cfg, tok)
    instance = {}
    for i, r in enumerate(reqs):
        instance.setdefault(r.conversation, set()).add(i % 2)
    assert sum(len(s) == 2 for s in instance.values()) >= 6  # most move at least once


def test_chat_system_prompts_open_each_conversation_and_leave_the_turns_alone(tok):
    base = WorkloadConfig(kind="chat", num_prompts=8, turns=2, num_prefixes=2,
                          input_len=LengthDist("fixed", 8), seed=3)
    plain = build_requests(base, tok)
    reqs = build_requests(replace(base, system_len=40), tok)
    first = sorted((r for r in reqs if r.turn == 0), key=lambda r: r.conversation)
    assert [r.messages[0][0] for r in first] == ["system"] * 4
    systems = [r.messages[0][1] for r in first]
    assert systems[0] == systems[2] != systems[1] == systems[3]  # conversation c: c % 2
    assert all(r.prompt_len == 8 + 40 for r in first)
    assert all(len(r.messages) == 1 and r.prompt_len == 8 for r in reqs if r.turn == 1)
    # the user turns are the ones the workload draws without system prompts
    turns = (lambda rs: {(r.conversation, r.turn): r.messages[-1] for r in rs})
    assert turns(reqs) == turns(plain)
    with pytest.raises(ValueError, match="system_len"):
        WorkloadConfig(kind="chat", system_len=-1)


def test_jsonl_workload_reads_tiers_and_cycles(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "hello", "tier": "fast", "max_tokens": 3},
             {"messages": [{"role": "user", "content": "hi"}]},
             {"prompt_ids": [1, 2, 3]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    cfg = WorkloadConfig(kind="jsonl", path=str(path), num_prompts=4,
                         output_len=LengthDist("fixed", 9), tier="slow")
    reqs = build_requests(cfg, tok)
    assert [r.tier for r in reqs] == ["fast", "slow", "slow", "fast"]
    assert [r.max_tokens for r in reqs] == [3, 9, 9, 3]
    assert reqs[0].prompt == "hello" and reqs[0].prompt_len == len(tok.encode("hello"))
    assert reqs[1].messages == (("user", "hi"),) and reqs[2].prompt_ids == (1, 2, 3)
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="line 1"):
        build_requests(cfg, tok)
