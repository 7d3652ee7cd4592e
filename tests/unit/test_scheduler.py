"""Scheduler with a scripted fake runner: exact block ids, the token budget, chunked prefill,
preemption and every state transition, cancel in each state."""

import pytest

from pdserve.common.engine.request import InvalidTransition, Request, RequestStatus as S
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.kv.block_pool import BlockPool
from pdserve.common.kv.kv_cache_manager import KVCacheManager
from pdserve.common.sampling_params import SamplingParams

BS = 4


def make(num_blocks=16, max_seqs=8, budget=32, caching=True):
    pool = BlockPool(num_blocks, caching)
    kv = KVCacheManager(pool, BS, "fake-model")
    return Scheduler(kv, max_seqs, budget), kv, pool


def req(rid, n_prompt, first=0, max_tokens=8):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   max_tokens)


def run_step(sched, next_token=7):
    """The fake runner: every scheduled chunk is computed; completed ones get a token."""
    out = sched.schedule()
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(next_token)
        sched.kv.cache_blocks(r)
    return out


def test_exact_blocks_and_budget_with_chunked_prefill():
    sched, kv, pool = make(budget=8)
    a, b = req("a", 10), req("b", 3, first=100)
    sched.add_request(a)
    sched.add_request(b)
    out = run_step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 8)]  # chunk, budget full
    assert kv.block_ids("a") == [0, 1]
    assert a.status == S.RUNNING and b.status == S.WAITING
    out = run_step(sched)  # a finishes its prompt (2 tokens), b fits in the rest (3)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 2), ("b", 3)]
    assert kv.block_ids("a") == [0, 1, 2] and kv.block_ids("b") == [3]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    out = run_step(sched)  # both decode: one token each
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]
    assert out.num_tokens == 2
    assert kv.block_ids("b") == [3]  # b's 5th token (index 4) -> new block
    assert a.history == [S.WAITING, S.RUNNING]


def test_prefix_cache_hit_reuses_exact_blocks():
    sched, kv, pool = make()
    a = req("a", 9)
    sched.add_request(a)
    run_step(sched)
    sched.finish("a", S.FINISHED)
    assert a.history[-2:] == [S.FINISHED, S.RECLAIMED]
    b = req("b", 9)  # same prompt -> 2 full blocks cached
    sched.add_request(b)
    out = run_step(sched)
    assert out.scheduled[0][1] == 1  # only the last token computed
    assert kv.block_ids("b")[:2] == [0, 1]
    assert b.num_cached_tokens == 8
    assert kv.prefix_hits == 8


def test_preemption_by_recompute_under_pressure():
    sched, kv, pool = make(num_blocks=4, budget=64)
    a, b = req("a", 7), req("b", 7, first=50)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # a: blocks 0,1 ; b: blocks 2,3 ; each has 8 tokens, 7 computed
    assert pool.num_free_blocks == 0
    run_step(sched)  # token 7 still fits in block 1 / 3
    out = run_step(sched)  # a needs a 3rd block for token 8 -> b (newest) is preempted
    assert out.preempted == ["b"]
    assert b.history == [S.WAITING, S.RUNNING, S.PREEMPTED, S.WAITING]
    assert b.num_computed_tokens == 0 and sched.waiting[0] is b
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1)]
    assert sched.num_preemptions == 1
    sched.finish("a", S.FINISHED)
    out = run_step(sched)  # b comes back: recompute prompt + its output token
    assert out.scheduled[0][0] is b and b.status == S.RUNNING


def test_cancel_in_every_state():
    sched, kv, pool = make(num_blocks=4, budget=64)
    w = req("w", 3)
    sched.add_request(w)
    sched.finish("w", S.CANCELLED)  # WAITING
    assert w.history == [S.WAITING, S.CANCELLED, S.RECLAIMED]
    r = req("r", 3)
    sched.add_request(r)
    run_step(sched)
    sched.finish("r", S.CANCELLED)  # RUNNING
    assert r.history == [S.WAITING, S.RUNNING, S.CANCELLED, S.RECLAIMED]
    a, b = req("a", 7), req("b", 7, first=50)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        run_step(sched)  # the third step preempts b, back to WAITING
    sched.finish("b", S.CANCELLED)
    assert b.history[-4:] == [S.PREEMPTED, S.WAITING, S.CANCELLED, S.RECLAIMED]
    k = req("k", 3)
    sched.add_request(k)
    k.transition(S.WAITING_FOR_KV)  # a consumer parks it while KV loads
    sched.finish("k", S.CANCELLED)
    assert k.history == [S.WAITING, S.WAITING_FOR_KV, S.CANCELLED, S.RECLAIMED]
    sched.finish("a", S.CANCELLED)
    assert pool.num_free_blocks == 4 and not sched.requests
    assert sched.finish("a", S.CANCELLED) is None  # idempotent


def test_illegal_transitions_raise():
    r = req("x", 3)
    with pytest.raises(InvalidTransition):
        r.transition(S.FINISHED)  # WAITING -> FINISHED skips RUNNING
    r.transition(S.RUNNING)
    r.transition(S.FINISHED)
    with pytest.raises(InvalidTransition):
        r.transition(S.RUNNING)


def test_max_num_seqs_and_no_room():
    sched, kv, pool = make(num_blocks=3, max_seqs=2, budget=64)
    for i in range(3):
        sched.add_request(req(f"r{i}", 2, first=10 * i))
    out = run_step(sched)
    assert len(out.scheduled) == 2  # max_num_seqs
    sched2, _, _ = make(num_blocks=2, budget=64)
    big = req("big", 12)  # needs 3 blocks, pool has 2: stays waiting, nothing allocated
    sched2.add_request(big)
    assert run_step(sched2).scheduled == [] and big.status == S.WAITING


def test_prefix_lookup_counts_once_per_request_not_per_attempt():
    sched, kv, pool = make(num_blocks=3, budget=64)
    a = req("a", 8)
    sched.add_request(a)
    run_step(sched)  # a holds 2 of 3 blocks
    b = req("b", 12, first=50)  # needs 3 blocks: waits while a runs
    sched.add_request(b)
    for _ in range(3):
        run_step(sched)
    assert b.status == S.WAITING
    assert kv.prefix_queries == 8  # a's lookup only; b's repeated attempts are not counted
    sched.finish("a", S.FINISHED)
    run_step(sched)
    assert b.status == S.RUNNING and kv.prefix_queries == 8 + 12
