"""The KV store's offset allocator: first fit, coalescing frees, rebuild by reserve."""

import random

import pytest

from pdserve.services.kvstore.allocator import ALIGN, OffsetAllocator


def test_first_fit_reuses_the_lowest_hole_and_aligns():
    a = OffsetAllocator(10 * ALIGN)
    offs = [a.allocate(ALIGN) for _ in range(3)]
    assert offs == [0, ALIGN, 2 * ALIGN]
    a.free(ALIGN)
    assert a.allocate(1) == ALIGN  # 1 byte rounds up to one aligned slot, in the hole
    assert a.allocate(ALIGN + 1) == 3 * ALIGN
    assert a.used_bytes == 3 * ALIGN + 2 * ALIGN


def test_frees_coalesce_into_one_range():
    a = OffsetAllocator(4 * ALIGN)
    offs = [a.allocate(ALIGN) for _ in range(4)]
    assert a.allocate(1) is None
    for o in (offs[1], offs[3], offs[0], offs[2]):
        a.free(o)
    assert a.largest_free() == 4 * ALIGN and a.free_bytes == 4 * ALIGN
    assert a.allocate(4 * ALIGN) == 0


def test_double_free_and_bad_sizes_raise():
    a = OffsetAllocator(2 * ALIGN)
    o = a.allocate(10)
    a.free(o)
    with pytest.raises(ValueError):
        a.free(o)
    with pytest.raises(ValueError):
        a.allocate(0)
    with pytest.raises(ValueError):
        OffsetAllocator(0)


def test_reserve_rebuilds_the_same_layout():
    a = OffsetAllocator(8 * ALIGN)
    a.reserve(3 * ALIGN, ALIGN)
    a.reserve(0, 2 * ALIGN)
    with pytest.raises(ValueError):
        a.reserve(ALIGN, ALIGN)  # overlaps
    assert a.allocate(ALIGN) == 2 * ALIGN
    assert a.allocate(2 * ALIGN) == 4 * ALIGN
    assert a.used_bytes == 6 * ALIGN


def test_random_operations_keep_the_accounting():
    rng = random.Random(7)
    cap = 1000 * ALIGN
    a = OffsetAllocator(cap)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rng.randint(1, 20 * ALIGN)
            off = a.allocate(size)
            if off is not None:
                live[off] = -(-size // ALIGN) * ALIGN
        spans = sorted(live.items())
        assert all(o1 + s1 <= o2 for (o1, s1), (o2, _) in zip(spans, spans[1:]))  # no overlap
        assert all(o + s <= cap for o, s in spans)
        assert a.used_bytes == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.largest_free() == cap
