"""Block pool accounting under arbitrary operation sequences (hypothesis), plus the basics."""

import hashlib

import pytest
from hypothesis import given, settings, strategies as st

from pdserve.common.kv.block_pool import BlockPool


def _h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _check(pool: BlockPool, held: list) -> None:
    free, cached, in_use = pool.counts()
    assert free + cached + in_use == pool.num_blocks
    assert pool.num_free_blocks == free + cached
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    assert sum(b.ref_cnt for b in pool.blocks) == sum(len(h) for h in held)
    assert len(list(pool.free_queue)) == pool.free_queue.size
    for h, b in pool.cached.items():
        assert b.block_hash == h


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit"]),
                         st.integers(0, 6)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12))
def test_accounting_holds_after_any_sequence(ops, num_blocks):
    pool = BlockPool(num_blocks)
    held: list[list] = []  # each entry: the blocks one "request" references
    for op, k in ops:
        if op == "alloc":
            if k <= pool.num_free_blocks:
                held.append(pool.get_new_blocks(k))
            else:
                with pytest.raises(ValueError):
                    pool.get_new_blocks(k)
        elif op == "free" and held:
            pool.free_blocks(reversed(held.pop(k % len(held))))
        elif op == "cache" and held:
            blocks = held[k % len(held)]
            for j, b in enumerate(blocks):
                pool.cache_full_block(b, _h(b.block_id * 100 + j))
        elif op == "hit" and pool.cached:
            key = sorted(pool.cached)[k % len(pool.cached)]
            block = pool.get_cached_block(key)
            pool.touch([block])
            held.append([block])
        _check(pool, held)
    for blocks in held:
        pool.free_blocks(blocks)
    assert pool.num_free_blocks == num_blocks
    _check(pool, [])


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])


def test_lru_eviction_order_and_cache_hit_removes_from_middle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, _h(i))
    pool.free_blocks(reversed(blocks))  # tail first: block 3 evicted first
    assert [b.block_id for b in pool.free_queue] == [3, 2, 1, 0]
    hit = pool.get_cached_block(_h(1))
    pool.touch([hit])  # O(1) removal from the middle
    assert [b.block_id for b in pool.free_queue] == [3, 2, 0]
    (new,) = pool.get_new_blocks(1)
    assert new.block_id == 3 and new.block_hash is None
    assert pool.get_cached_block(_h(3)) is None  # evicted
    assert pool.get_cached_block(_h(0)) is blocks[0]  # still cached while free


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, _h(0))
    assert pool.get_cached_block(_h(0)) is None
