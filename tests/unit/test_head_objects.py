"""Head objects (connector/head_objects.py): a block stored as one object per KV head, so a
tensor-parallel rank moves only its own heads' bytes; what any layout writes, any layout reads;
every object keeps its own MAC."""

import pytest
import torch

from pdserve.connector.codec import BlockCodec, BlockCodecError
from pdserve.connector.head_objects import HeadObjects, RankHeads

FP = "ab" * 32
LAYERS, BLOCKS, BS, K, D = 2, 4, 4, 3, 8
KEY = b"k" * 32
LAYOUTS = {1: (3,), 2: (2, 1), 3: (1, 1, 1)}  # T -> each rank's heads (contiguous runs)


def objects(k=K):
    return HeadObjects(BlockCodec(FP, LAYERS, BS, k, D))


def ranks(tp, fill=None):
    """The ranks of a TP=tp engine: their caches (random, or zeros) and their sides."""
    out, offset = [], 0
    for h in LAYOUTS[tp]:
        caches = [torch.randn(2, BLOCKS, BS, h, D) if fill is None else torch.zeros(
            2, BLOCKS, BS, h, D) for _ in range(LAYERS)]
        out.append(RankHeads(objects(), caches, offset))
        offset += h
    return out


def whole_block(sides, block_id):
    """[L, 2, bs, K, d]: every rank's heads of a block, joined in head order."""
    return torch.stack([torch.cat([s.caches[l][:, block_id] for s in sides], dim=-2)
                        for l in range(LAYERS)])


@pytest.mark.parametrize("writer", [1, 2, 3])
@pytest.mark.parametrize("reader", [1, 2, 3])
def test_what_one_layout_writes_another_reads_each_rank_its_own_heads(writer, reader):
    store = {}
    src = ranks(writer)
    for side in src:
        objs = side.encode(KEY, 1)
        assert len(objs) == side.num_heads  # only its heads' bytes move
        assert all(len(o) == side.objects.head_codec.nbytes for _, o in objs)
        store.update(objs)
    assert len(store) == K and KEY in store  # the last head's object is the block's key
    dst = ranks(reader, fill=0)
    for side in dst:
        side.install(KEY, 2, [memoryview(store[k]) for k in side.keys(KEY)])
    assert torch.equal(whole_block(dst, 2), whole_block(src, 1))
    assert not any(s.caches[0][:, 1].any() for s in dst)  # other blocks untouched


def test_keys_are_layout_independent_and_bound_to_the_head_count():
    by_layout = [[k for s in ranks(tp, fill=0) for k in s.keys(KEY)] for tp in LAYOUTS]
    assert by_layout[0] == by_layout[1] == by_layout[2]
    assert len(set(by_layout[0])) == K and by_layout[0][-1] == KEY
    assert objects(4).key(KEY, 0) != objects(3).key(KEY, 0)
    with pytest.raises(ValueError):
        objects().key(KEY, K)


def test_a_swapped_or_altered_head_object_is_rejected_before_anything_is_written():
    src, dst = ranks(3), ranks(1, fill=0)
    objs = {k: bytearray(o) for side in src for k, o in side.encode(KEY, 0)}
    keys = dst[0].keys(KEY)
    swapped = [memoryview(objs[keys[1]]), memoryview(objs[keys[0]]), memoryview(objs[keys[2]])]
    with pytest.raises(BlockCodecError):
        dst[0].install(KEY, 0, swapped)
    objs[keys[2]][-1] ^= 1
    with pytest.raises(BlockCodecError):
        dst[0].install(KEY, 0, [memoryview(objs[k]) for k in keys])
    assert not dst[0].caches[0].any() and not dst[0].caches[1].any()


def test_a_rank_outside_the_blocks_heads_is_refused():
    caches = [torch.zeros(2, BLOCKS, BS, 2, D) for _ in range(LAYERS)]
    with pytest.raises(ValueError):
        RankHeads(objects(), caches, 2)  # heads [2, 4) of 3
    with pytest.raises(ValueError):
        RankHeads(objects(), caches[:1], 0)
