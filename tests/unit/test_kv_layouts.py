"""KV hand-off across tensor-parallel layouts (issue 15 item 3), tiny model (2 KV heads): a
block in the store holds every head whatever layout wrote it, so prefill with TP=a and decode
with TP=b exchange KV through the store, and the greedy tokens equal a colocated TP=1 engine's.
Chunked prefill (a 16-token budget) runs in every engine."""

import glob
import time

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
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


def engine(tiny, tp, store=None, role="both"):
    factory = None
    if store is not None:
        def factory(e):
            c = e.model_config
            codec = BlockCodec(e.fingerprint, c.num_layers, BS, c.num_kv_heads, c.head_dim)
            return StoreKVConnector(store, codec, ConnectorConfig(role=role))
    cfg = EngineConfig(model="tiny", num_threads=1,
                       cache=CacheConfig(num_blocks=64, block_size=BS),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=256),
                       parallel=ParallelConfig(tensor_parallel_size=tp))
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
        rest = run(decode, [(f"r{i}", p, GREEDY, first[f"r{i}"][0])
                            for i, p in enumerate(PROMPTS)])
        stats = decode.connector.stats
        # every prompt block loaded (decode may then save its answers' blocks too: KV reuse)
        assert stats.blocks_loaded == stored and stats.load_failures == 0
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
