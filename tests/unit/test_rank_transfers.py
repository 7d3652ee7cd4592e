"""Per-rank transfers (connector/rank_transfers.py): each rank of a TP layout saves and loads
only its own heads' objects through one store, and rank 0's tally finishes a transfer only
when every rank reported it, with the smallest block count any rank reached."""

import threading
import time

import pytest
import torch

from pdserve.common.engine.kv_rank_messages import BlockRef, Transfer, TransferReport
from pdserve.common.engine.rank_kv_tally import Completions
from pdserve.connector.codec import BlockCodec
from pdserve.connector.head_objects import HeadObjects, RankHeads
from pdserve.connector.io_thread import IOThread
from pdserve.connector.rank_transfers import RankTransfers
from pdserve.connector.store import InMemoryBlockStore

FP = "ab" * 32
LAYERS, BLOCKS, BS, K, D = 2, 6, 4, 3, 8
LAYOUTS = {1: (3,), 2: (2, 1), 3: (1, 1, 1)}  # T -> each rank's heads
KEYS = [bytes([i]) * 32 for i in range(1, 4)]


@pytest.fixture
def io():
    t = IOThread()
    yield t
    t.close()


def engine(tp, store, io, fill=None):
    """The ranks of a TP=tp engine over one store, caches random (or zeros)."""
    objects = HeadObjects(BlockCodec(FP, LAYERS, BS, K, D))
    out, offset = [], 0
    for rank, h in enumerate(LAYOUTS[tp]):
        caches = [torch.randn(2, BLOCKS, BS, h, D) if fill is None else torch.zeros(
            2, BLOCKS, BS, h, D) for _ in range(LAYERS)]
        out.append(RankTransfers(RankHeads(objects, caches, offset), store, io, rank,
                                 lease_s=30.0, load_timeout_s=5.0))
        offset += h
    return out


def block(ranks, block_id):
    """[L, 2, bs, K, d]: every rank's heads of a block, in head order."""
    return torch.stack([torch.cat([r.heads.caches[l][:, block_id] for r in ranks], dim=-2)
                        for l in range(LAYERS)])


def run(ranks, t):
    """Start t on every rank, wait for every report, tally them on 'rank 0'."""
    tally = Completions(len(ranks))
    tally.expect(t)
    for r in ranks:
        r.start(t)
    deadline, reports = time.monotonic() + 10, []
    while len(reports) < len(ranks):
        assert time.monotonic() < deadline, "a rank never reported"
        for r in ranks:
            reports += r.poll()
        time.sleep(0.005)
    results = [tally.add(rep) for rep in reports]
    assert results[:-1] == [None] * (len(ranks) - 1)  # finished only on the last report
    assert tally.open == 0 and all(r.in_flight == 0 for r in ranks)
    return reports, results[-1]


def save(ids):
    return Transfer("req", "save", tuple(BlockRef(k, b) for k, b in zip(KEYS, ids)))


def load(ids):
    return Transfer("req", "load", tuple(BlockRef(k, b) for k, b in zip(KEYS, ids)))


@pytest.mark.parametrize("writer,reader", [(2, 1), (1, 2), (3, 1), (2, 3)])
def test_each_rank_moves_its_heads_and_another_layout_reads_the_blocks(io, writer, reader):
    store = InMemoryBlockStore()
    src = engine(writer, store, io)
    reports, n = run(src, save([0, 1, 2]))
    assert n == 3 and len(store.objects) == 3 * K
    assert sorted(r.rank for r in reports) == list(range(writer))
    dst = engine(reader, store, io, fill=0)
    gets = store.gets
    _, n = run(dst, load([3, 4, 5]))
    assert n == 3 and store.gets - gets == 3 * K  # each head object read once, by its rank
    for i in range(3):
        assert torch.equal(block(dst, 3 + i), block(src, i))
    assert not any(r.heads.caches[0][:, :3].any() for r in dst)


def test_a_head_object_one_rank_misses_ends_the_load_for_every_rank_there(io):
    store = InMemoryBlockStore()
    src = engine(1, store, io)
    run(src, save([0, 1, 2]))
    del store.objects[src[0].heads.objects.key(KEYS[1], 0)]  # only rank 0 of TP=2 reads it
    dst = engine(2, store, io, fill=0)
    reports, n = run(dst, load([3, 4, 5]))
    assert {r.rank: r.blocks for r in reports} == {0: 1, 1: 3}
    assert n == 1  # the engine recomputes from block 1
    assert torch.equal(block(dst, 3), block(src, 0))


def test_a_corrupted_head_object_is_not_installed(io):
    store = InMemoryBlockStore()
    src = engine(1, store, io)
    run(src, save([0, 1, 2]))
    key = src[0].heads.objects.key(KEYS[0], 2)
    store.objects[key] = store.objects[key][:-1] + bytes([store.objects[key][-1] ^ 1])
    dst = engine(3, store, io, fill=0)
    reports, n = run(dst, load([3, 4, 5]))
    assert n == 0 and {r.rank: r.blocks for r in reports} == {0: 3, 1: 3, 2: 0}
    assert not dst[2].heads.caches[0].any() and not dst[2].heads.caches[1].any()


def test_a_store_that_is_down_fails_saves_and_loads_but_every_rank_reports(io):
    store = InMemoryBlockStore()
    store.down = True
    _, n = run(engine(2, store, io), save([0, 1, 2]))
    assert n == 0 and not store.objects
    _, n = run(engine(2, store, io, fill=0), load([3, 4, 5]))
    assert n == 0


def test_reports_reach_a_callback_without_anyone_polling(io):
    """A worker's reports go out from its I/O thread: its step loop may be blocked waiting
    for a step that rank 0 only sends once the report came."""
    store, got, arrived = InMemoryBlockStore(), [], threading.Event()

    def on_report(report):
        got.append(report)
        arrived.set()

    rank = engine(1, store, io)[0]
    rank.on_report = on_report
    rank.start(save([0, 1]))
    assert arrived.wait(10)
    assert got == [TransferReport("req", "save", 0, 2)] and rank.poll() == []


def test_the_tally_refuses_reports_it_did_not_ask_for():
    tally = Completions(2)
    t = save([0, 1])
    tally.expect(t)
    with pytest.raises(ValueError):
        tally.expect(t)  # one save of a request at a time
    for bad in (TransferReport("req", "save", 2, 1),  # no such rank
                TransferReport("req", "save", 0, 3),  # more blocks than ordered
                TransferReport("other", "save", 0, 1),  # not in flight
                TransferReport("req", "load", 0, 1)):
        with pytest.raises(ValueError):
            tally.add(bad)
    forged = object.__new__(TransferReport)  # what unpickling builds: no __post_init__
    for name, value in (("request_id", "req"), ("kind", "save"), ("rank", 1), ("blocks", -1),
                        ("seq", 0)):
        object.__setattr__(forged, name, value)
    with pytest.raises(ValueError):
        tally.add(forged)
    assert tally.add(TransferReport("req", "save", 1, 2)) is None
    with pytest.raises(ValueError):
        tally.add(TransferReport("req", "save", 1, 2))  # a rank reports once
    assert tally.add(TransferReport("req", "save", 0, 1)) == 1 and tally.open == 0


def test_several_saves_of_one_request_in_flight_are_told_apart_by_seq(io):
    """Decode saves a block each step it fills: two saves of one request can be out at once."""
    store = InMemoryBlockStore()
    ranks = engine(2, store, io)
    tally = Completions(2)
    first = Transfer("req", "save", (BlockRef(KEYS[0], 0),), seq=7)
    second = Transfer("req", "save", (BlockRef(KEYS[1], 1), BlockRef(KEYS[2], 2)), seq=8)
    for t in (first, second):
        tally.expect(t)
        for r in ranks:
            r.start(t)
    deadline, done = time.monotonic() + 10, {}
    while tally.open:
        assert time.monotonic() < deadline, "a rank never reported"
        for r in ranks:
            for rep in r.poll():
                n = tally.add(rep)
                if n is not None:
                    done[rep.seq] = n
        time.sleep(0.005)
    assert done == {7: 1, 8: 2} and len(store.objects) == 3 * K
    with pytest.raises(ValueError):
        tally.add(TransferReport("req", "save", 0, 1, 7))  # over: not in flight any more


def test_transfers_are_bounded_and_typed():
    with pytest.raises(ValueError):
        BlockRef(b"short", 0)
    with pytest.raises(ValueError):
        BlockRef(KEYS[0], -1)
    with pytest.raises(ValueError):
        Transfer("req", "save", ())
    with pytest.raises(ValueError):
        Transfer("req", "move", (BlockRef(KEYS[0], 0),))
    with pytest.raises(ValueError):
        Transfer("", "save", (BlockRef(KEYS[0], 0),))
    with pytest.raises(ValueError):
        TransferReport("req", "load", -1, 0)
    with pytest.raises(ValueError):
        TransferReport("req", "load", 0, "1")
    with pytest.raises(ValueError):
        Transfer("req", "save", (BlockRef(KEYS[0], 0),), seq=-1)
