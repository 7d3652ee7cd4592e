"""KV hand-off across tensor- and pipeline-parallel layouts (issue 15 item 3), tiny model (2
layers, 2 KV heads): a block in the store holds every layer and head whatever layout wrote it,
so prefill and decode in different layouts (TP=a, PP=b) exchange KV through the store, and the
greedy tokens equal a colocated TP=1 engine's. Chunked prefill (a 16-token budget) runs in
every engine; afterwards every block is back in its engine's pool."""

import glob
import time
from types import SimpleNamespace

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.common.distributed.kv_share import by_tensor_rank
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.models.registry import load_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.connector.codec import BlockCodec
from pdserve.connector.layout import HeadShards
from pdserve.connector.store import InMemoryBlockStore
from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector

BS = 16
PROMPTS = [list(range(1, 60)), list(range(100, 140)), [7] * 33]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def engine(tiny, tp, store=None, role="both", pp=1):
    factory = None
    if store is not None:
        def factory(e):
            c = e.model_config
            codec = BlockCodec(e.fingerprint, c.num_layers, BS, c.num_kv_heads, c.head_dim)
            return StoreKVConnector(store, codec, ConnectorConfig(role=role))
    cfg = EngineConfig(model="tiny", num_threads=1,
                       cache=CacheConfig(num_blocks=64, block_size=BS),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=256),
                       parallel=ParallelConfig(tensor_parallel_size=tp,
                                               pipeline_parallel_size=pp))
    return EngineCore(cfg, tiny, factory)


def run(core, requests):
    """requests: (rid, prompt, params, first token or None) -> {rid: tokens}."""
    for rid, ids, params, first in requests:
        core.add_request(rid, ids, params, first_token_id=first)
    got = {rid: [] for rid, *_ in requests}
    deadline = time.monotonic() + 60
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        for o in core.step():
            got[o.request_id].extend(o.new_token_ids)
    return got


@pytest.fixture(scope="module")
def reference(tiny):
    core = engine(tiny, 1)
    try:
        return run(core, [(f"r{i}", p, GREEDY, None) for i, p in enumerate(PROMPTS)])
    finally:
        core.close()


def decode_rest(decode, first, stored):
    """Decode every prompt after the first token its prefill sampled: {rid: the rest}."""
    rest = run(decode, [(f"r{i}", p, GREEDY, first[f"r{i}"][0]) for i, p in enumerate(PROMPTS)])
    stats = decode.connector.stats
    # every prompt block loaded (decode may then save its answers' blocks too: KV reuse)
    assert stats.blocks_loaded == stored and stats.load_failures == 0
    return rest


def _shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/pdserve-kv*"))


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)])
def test_prefill_and_decode_in_different_layouts_equal_colocated_tp1(
        tiny, reference, prefill_tp, decode_tp):
    before = _shm_files()
    store = InMemoryBlockStore()
    prefill = engine(tiny, prefill_tp, store, "producer")
    try:
        first = run(prefill, [(f"r{i}", p, FIRST, None) for i, p in enumerate(PROMPTS)])
    finally:
        prefill.close()
    stored = sum(len(p) // BS for p in PROMPTS)
    assert len(store.objects) == stored
    decode = engine(tiny, decode_tp, store, "consumer")
    try:
        rest = decode_rest(decode, first, stored)
    finally:
        decode.close()
    assert {r: first[r] + rest[r] for r in rest} == reference
    assert _shm_files() == before  # every rank's shared KV file is gone


def test_a_store_hit_written_by_one_layout_is_read_by_another(tiny, reference):
    """A TP=2 instance stores every block (role both); a TP=1 instance with no prefill of its
    own loads them as a plain prefix hit, with no hint, and its tokens are unchanged."""
    store = InMemoryBlockStore()
    writer = engine(tiny, 2, store)
    try:
        assert run(writer, [(f"r{i}", p, GREEDY, None)
                            for i, p in enumerate(PROMPTS)]) == reference
    finally:
        writer.close()
    reader = engine(tiny, 1, store, "consumer")
    try:
        got = run(reader, [(f"r{i}", p, GREEDY, None) for i, p in enumerate(PROMPTS)])
        assert reader.connector.stats.blocks_loaded == sum(len(p) // BS for p in PROMPTS)
    finally:
        reader.close()
    assert got == reference


def test_ranks_of_every_stage_join_into_one_view_per_tensor_rank():
    """TP=2 x PP=2 over 3 layers and 3 KV heads: global rank r = stage * 2 + tensor rank holds
    its stage's layers (2 + 1) and its heads (2 + 1); joined per tensor rank, a whole block
    written through HeadShards lands in each rank's own cache at its local layer index."""
    layers, blocks, d, tp = 3, 4, 5, 2
    per_rank = [[torch.zeros(2, blocks, BS, h, d) for _ in range(n)]
                for n, h in ((2, 2), (2, 1), (1, 2), (1, 1))]  # rank order
    heads = HeadShards(by_tensor_rank(per_rank, tp))
    assert heads.num_layers == layers and heads.offsets == [0, 2]
    block = torch.randn(layers, 2, BS, 3, d)
    heads.write_block(1, block)
    assert torch.equal(heads.read_block(1), block)
    assert torch.equal(per_rank[3][0][:, 1], block[2, ..., 2:3, :])  # stage 1, tensor rank 1
    assert torch.equal(per_rank[2][0][:, 1], block[2, ..., 0:2, :])
    assert torch.equal(per_rank[1][1][:, 1], block[1, ..., 2:3, :])
    assert not per_rank[0][0][:, 0].any()  # other blocks untouched


def test_head_shards_split_and_join_blocks_in_head_order():
    """Ranks holding heads [0, 2) and [2, 3) of 3: a block read back equals the one written,
    and each rank's cache holds its own heads of it."""
    layers, blocks, d = 2, 4, 5
    shards = [[torch.zeros(2, blocks, BS, h, d) for _ in range(layers)] for h in (2, 1)]
    heads = HeadShards(shards)
    assert heads.num_kv_heads == 3 and heads.offsets == [0, 2]
    block = torch.randn(layers, 2, BS, 3, d)
    heads.write_block(2, block)
    assert torch.equal(heads.read_block(2), block)
    assert torch.equal(shards[1][1][:, 2], block[1, ..., 2:3, :])
    out = torch.empty(1, 2, BS, 3, d)
    heads.copy_layer_into(out, 1, torch.tensor([2]))
    assert torch.equal(out[0], block[1])


def assert_all_blocks_free(core):
    """No save, load or step in flight holds a block of `core` (nothing leaked)."""
    assert not core.scheduler.held and not core.has_unfinished_requests()
    assert core.num_free_blocks == core.num_total_blocks


def test_prefill_with_pipeline_stages_feeds_decode_and_a_later_store_hit_at_tp1(
        tiny, reference):
    """Prefill PP=2 (the later stage's layer saved from shared memory once each step came
    back) -> decode TP=1 with the hint; then a TP=1 instance with no hint reads the same
    blocks as a plain prefix hit. (TP=2 x PP=2 joins the ranks' caches as below,
    test_ranks_of_every_stage_join_into_one_view_per_tensor_rank.)"""
    before = _shm_files()
    store = InMemoryBlockStore()
    prefill = engine(tiny, 1, store, "producer", pp=2)
    try:
        first = run(prefill, [(f"r{i}", p, FIRST, None) for i, p in enumerate(PROMPTS)])
        assert_all_blocks_free(prefill)
    finally:
        prefill.close()
    stored = sum(len(p) // BS for p in PROMPTS)
    assert len(store.objects) == stored
    for hint in (True, False):
        decode = engine(tiny, 1, store, "consumer")
        try:
            rest = run(decode, [(f"r{i}", p, GREEDY, first[f"r{i}"][0] if hint else None)
                                for i, p in enumerate(PROMPTS)])
            stats = decode.connector.stats
            assert stats.blocks_loaded == stored and stats.load_failures == 0
            assert_all_blocks_free(decode)
        finally:
            decode.close()
        got = {r: first[r] + rest[r] for r in rest} if hint else rest
        assert got == reference
    assert _shm_files() == before


def test_decode_with_pipeline_stages_loads_every_stage_and_holds_an_aborted_request(
        tiny, reference):
    """Prefill TP=1 -> decode PP=2: a load writes both stages' layers through shared memory.
    A request aborted while its step is down the pipeline keeps its blocks (held) until the
    step came back, then every block returns to the pool."""
    before = _shm_files()
    store = InMemoryBlockStore()
    prefill = engine(tiny, 1, store, "producer")
    try:
        first = run(prefill, [(f"r{i}", p, FIRST, None) for i, p in enumerate(PROMPTS)])
    finally:
        prefill.close()
    decode = engine(tiny, 1, store, "consumer", pp=2)
    ex = decode.executor
    flying, submit, collect = [], ex.submit, ex.collect

    def tracked_submit(out):
        submit(out)
        flying.append({c.request_id for c in out.chunks})

    def tracked_collect():
        flying.pop(0)
        return collect()

    ex.submit, ex.collect = tracked_submit, tracked_collect
    try:
        for i, p in enumerate(PROMPTS):
            decode.add_request(f"r{i}", p, GREEDY, first_token_id=first[f"r{i}"][0])
        decode.add_request("gone", list(range(30, 70)), GREEDY)
        got = {f"r{i}": list(first[f"r{i}"]) for i in range(len(PROMPTS))}
        aborted, deadline = False, time.monotonic() + 60
        while decode.has_unfinished_requests():
            assert time.monotonic() < deadline, "engine did not finish"
            for o in decode.step():
                if o.request_id in got:
                    got[o.request_id].extend(o.new_token_ids)
            if not aborted and any("gone" in f for f in flying):
                decode.abort_request("gone")
                assert "gone" in decode.scheduler.held  # its step still uses its blocks
                aborted = True
        assert aborted and got == reference
        stats = decode.connector.stats
        assert stats.blocks_loaded == sum(len(p) // BS for p in PROMPTS)
        assert stats.load_failures == 0
        assert_all_blocks_free(decode)
    finally:
        decode.close()
    assert _shm_files() == before


def test_a_pipelined_step_is_saved_whole_when_it_comes_back_and_holds_its_requests_till_then():
    """The connector alone (no processes), over TP=2 x PP=2 caches: `stage_step` holds every
    request of the step (request_finished -> True: an abort in flight keeps its blocks);
    what the stages write after it is what `save_step` stores, every layer and head in TP=1
    order; a request with no full block is released at once, one with blocks once its put
    is done."""
    layers, kvh, d = 2, 3, 4
    per_rank = [[torch.zeros(2, 8, BS, h, d)] for h in (2, 1, 2, 1)]  # one layer per stage
    codec = BlockCodec("00" * 32, layers, BS, kvh, d)
    store = InMemoryBlockStore()
    conn = StoreKVConnector(store, codec, ConnectorConfig(role="producer"))
    try:
        conn.register_kv_shards(by_tensor_rank(per_rank, 2))

        def req(rid, computed):
            return SimpleNamespace(request_id=rid, num_computed_tokens=computed,
                                   block_hashes=[rid.encode() * 32])

        full, partial = req("a", 0), req("b", 3)
        handle = conn.stage_step([(full, BS, [5]), (partial, 1, [6])])
        assert conn.request_finished(full, [5]) and conn.request_finished(partial, [6])
        block = torch.randn(layers, 2, BS, kvh, d)
        HeadShards(by_tensor_rank(per_rank, 2)).write_block(5, block)  # "the stages ran"
        conn.save_step(handle)
        saved, _ = conn.get_finished()
        assert "b" in saved  # nothing to put: released when the step came back
        deadline = time.monotonic() + 10
        while "a" not in saved:
            assert time.monotonic() < deadline, "the put did not finish"
            time.sleep(0.01)
            saved |= conn.get_finished()[0]
        key = b"a" * 32
        assert torch.equal(codec.decode(key, memoryview(bytearray(store.objects[key]))), block)
        assert len(store.objects) == 1
    finally:
        conn.close()
