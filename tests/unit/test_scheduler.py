"""Scheduler with a scripted fake runner: exact block ids, the token budget, chunked prefill,
preemption and every state transition, cancel in each state."""

import pytest

from pdserve.common.engine.request import InvalidTransition, Request, RequestStatus as S
from pdserve.common.engine.sampler import SamplerOutput
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
    """The fake runner: every scheduled chunk is computed; completed ones get a token. Returns
    the step as (request, new tokens) pairs and the preempted ids."""
    out = sched.schedule()
    n_sampled = len(sched.sampled_requests(out))
    sched.update_from_output(out, SamplerOutput([next_token] * n_sampled, None))
    return Step([(sched.requests[c.request_id], c.num_tokens) for c in out.chunks],
                list(out.preempted), out.num_tokens)


class Step:
    def __init__(self, scheduled, preempted, num_tokens):
        self.scheduled, self.preempted, self.num_tokens = scheduled, preempted, num_tokens


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


def test_output_is_a_frozen_picklable_value_with_block_ids():
    import dataclasses
    import pickle

    sched, kv, pool = make(budget=8)
    a, b, c = req("a", 10), req("b", 1, first=100), req("c", 2, first=200)
    for r in (c, b, a):
        sched.add_request(r)
    out = sched.schedule()
    # decodes (1 new token) first, then the prefill chunk; a is cut at the budget
    assert [(c.request_id, c.token_ids, c.start, c.block_ids, c.sample) for c in out.chunks] \
        == [("b", (100,), 0, (1,), True), ("c", (200, 201), 0, (0,), True),
            ("a", tuple(range(5)), 0, (2, 3), False)]
    assert pickle.loads(pickle.dumps(out)) == out
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.chunks[0].start = 3
    assert [r.request_id for r in sched.sampled_requests(out)] == ["b", "c"]
    emitted = sched.update_from_output(out, SamplerOutput([42, 43], None))
    assert emitted == [b, c] and b.output_token_ids == [42] and c.output_token_ids == [43]
    assert a.num_computed_tokens == 5 and c.num_computed_tokens == 2


def test_update_from_output_finishes_through_the_stop_check():
    def stop_on_9(r, tok):
        if tok == 9:
            r.finish_reason = "stop"

    pool = BlockPool(8, True)
    kv = KVCacheManager(pool, BS, "fake-model")
    sched = Scheduler(kv, 8, 32, check_stop=stop_on_9)
    a = req("a", 5)
    sched.add_request(a)
    out = sched.schedule()
    assert sched.update_from_output(out, SamplerOutput([3], None)) == [a]
    assert a.status == S.RUNNING and a.finish_reason is None
    out = sched.schedule()
    assert sched.update_from_output(out, SamplerOutput([9], None)) == [a]
    assert a.history[-2:] == [S.FINISHED, S.RECLAIMED] and not sched.requests
    assert pool.num_free_blocks == 8 and not sched.has_unfinished()


class SavingConnector:
    """A producer whose saves finish when the test says so."""

    def __init__(self):
        self.saved = set()

    def get_num_new_matched_tokens(self, request, n):
        return 0

    def request_finished(self, request, block_ids):
        return True  # a save is in flight

    def finish_waits_for_save(self):
        return True

    def get_finished(self):
        saved, self.saved = self.saved, set()
        return saved, set()

    def get_failed_loads(self):
        return {}


def test_a_finished_producer_request_is_emitted_once_its_kv_is_saved():
    conn = SavingConnector()
    pool = BlockPool(8, True)
    kv = KVCacheManager(pool, BS, "fake-model")
    sched = Scheduler(kv, 8, 32, connector=conn,
                      check_stop=lambda r, tok: setattr(r, "finish_reason", "length"))
    a = req("a", 6)
    sched.add_request(a)
    out = sched.schedule()
    assert sched.update_from_output(out, SamplerOutput([5], None)) == []  # waits for its save
    assert a.status == S.FINISHED and "a" in sched.held and sched.has_unfinished()
    assert pool.num_free_blocks == 6  # blocks stay while the connector reads them
    idle = sched.schedule()
    assert idle.chunks == () and sched.update_from_output(idle, None) == []
    conn.saved.add("a")
    idle = sched.schedule()
    assert sched.update_from_output(idle, None) == [a]
    assert a.history[-1] == S.RECLAIMED and pool.num_free_blocks == 8
    assert not sched.has_unfinished()


def _book(sched, out, token=7):
    n = len(sched.sampled_requests(out))
    sched.update_from_output(out, SamplerOutput([token] * n, None))


def _chunks(out):
    return [(c.request_id, c.num_tokens) for c in out.chunks]


@pytest.mark.parametrize("depth, steps", [
    (1, [[("r0", 12), ("r1", 12), ("r2", 8)]]),
    # 1/2 of the budget per step: the burst splits into two micro-batches in flight together
    (2, [[("r0", 12), ("r1", 4)], [("r2", 12), ("r3", 4)]]),
])
def test_a_pipeline_step_takes_a_share_of_the_token_budget(depth, steps):
    pool = BlockPool(32, True)
    kv = KVCacheManager(pool, BS, "fake-model")
    sched = Scheduler(kv, 8, 32, pipeline_depth=depth)
    for i in range(4):
        sched.add_request(req(f"r{i}", 12, first=100 * i))
    outs = [sched.schedule() for _ in steps]
    assert [_chunks(o) for o in outs] == steps
    assert sched.step_token_budget() == 32 // depth
    for o in outs:
        _book(sched, o)
    sched.token_budget = 9  # the ITL controller's value: the share follows it
    assert sched.step_token_budget() == -(-9 // depth)


def test_without_chunked_prefill_a_prompt_over_the_share_goes_whole_and_alone():
    pool = BlockPool(32, True)
    kv = KVCacheManager(pool, BS, "fake-model")
    sched = Scheduler(kv, 8, 32, enable_chunked_prefill=False, pipeline_depth=2)
    for rid, n, first in [("a", 10, 0), ("b", 24, 100), ("c", 24, 200)]:
        sched.add_request(req(rid, n, first=first))
    first = sched.schedule()  # a (10 of the 16-token share); b is not cut, nor added
    assert _chunks(first) == [("a", 10)]
    second = sched.schedule()  # a is in flight; b, alone in its step, goes whole
    assert _chunks(second) == [("b", 24)]
    _book(sched, first)
    _book(sched, second)
    third = sched.schedule()  # a and b decode (2 of 3 sequences); c waits for the cap
    assert _chunks(third) == [("a", 1), ("b", 1)]
    assert sched.requests["c"].status == S.WAITING
    fourth = sched.schedule()  # c over the share, alone in its step: whole
    assert _chunks(fourth) == [("c", 24)]
    _book(sched, third)
    _book(sched, fourth)
    assert [sched.requests[r].num_computed_tokens for r in "abc"] == [11, 25, 24]
