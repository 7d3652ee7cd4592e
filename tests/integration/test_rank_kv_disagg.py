"""Issue 15's disaggregated tests in the connector's per-rank mode (ConnectorConfig.per_rank,
docs/parallelism.md "Per-rank transfers"), over the real KV store (master on Redis, two
nodes, store and block secrets): every tensor-parallel rank of an engine opens its own store
client and moves only its own KV heads, one object per head. Tiny model (2 layers, 2 KV
heads), chunked prefill (16-token budget): prefill TP=2 -> decode TP=1 and TP=1 -> TP=2 equal
a colocated TP=1 engine; a store hit written by a TP=2 engine is read by a TP=1 engine; no
engine maps shared-memory KV files in this mode, and every transfer is booked and every block
back in its pool afterwards. The engines are built as the engine service builds them
(engine_server.build_core: connector_factory and rank_kv_factory of one KVStoreSettings)."""

import time

import pytest

from pdserve.common.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.common.engine.engine_core import EngineCore
from pdserve.connector.rank_connector import RankKVConnector
from pdserve.services.engine_host.kv_connector_factory import (KVStoreSettings,
                                                               connector_factory,
                                                               rank_kv_factory)
from pdserve.tests.integration.rank_kv_cluster import cluster  # noqa: F401 - a fixture
# the colocated TP=1 reference, the prompts and the driver of the shared-memory mode's tests
from pdserve.tests.unit.test_kv_layouts import (BS, FIRST, GREEDY, PROMPTS,  # noqa: F401
                                                _shm_files, decode_rest, reference, run,
                                                tiny)

STORED = sum(len(p) // BS for p in PROMPTS)


def engine(tiny, tp, cluster, role="both", per_rank=True):
    cfg = EngineConfig(model="tiny", num_threads=1,
                       cache=CacheConfig(num_blocks=64, block_size=BS),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=256),
                       parallel=ParallelConfig(tensor_parallel_size=tp, all_reduce="gloo"))
    maddr, secret = cluster
    kv = KVStoreSettings(master_addr=maddr, role=role, transport="tcp", lookup_timeout_s=5.0,
                         block_secret_file=secret, per_rank=per_rank)
    core = EngineCore(cfg, tiny, connector_factory(kv),
                      rank_kv=rank_kv_factory(kv) if per_rank else None)
    assert isinstance(core.connector, RankKVConnector) == per_rank
    return core


def settle(core):
    """Every transfer the engine started booked; every block back in its pool."""
    deadline = time.monotonic() + 30
    while core.rank_kv is not None and core.rank_kv.open:  # a step books what it reports
        assert time.monotonic() < deadline, "a transfer was never reported"
        core.step()
        time.sleep(0.01)
    core.step()
    assert core.num_free_blocks == core.num_total_blocks


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_per_rank_prefill_and_decode_in_different_layouts_equal_colocated_tp1(
        tiny, reference, cluster, prefill_tp, decode_tp):
    before = _shm_files()
    prefill = engine(tiny, prefill_tp, cluster, "producer")
    try:
        first = run(prefill, [(f"r{i}", p, FIRST, None) for i, p in enumerate(PROMPTS)])
        assert _shm_files() == before  # per-rank mode: rank 0 maps no other rank's KV
        settle(prefill)
        assert prefill.connector.stats.blocks_saved == STORED
        assert prefill.connector.stats.save_failures == 0
    finally:
        prefill.close()
    decode = engine(tiny, decode_tp, cluster, "consumer")
    try:
        rest = decode_rest(decode, first, STORED)
        settle(decode)
    finally:
        decode.close()
    assert {r: first[r] + rest[r] for r in rest} == reference


def test_a_per_rank_store_hit_written_by_tp2_is_read_by_tp1(tiny, reference, cluster):
    """A TP=2 instance stores every block (role both, each rank its head); a TP=1 instance
    with no prefill of its own loads them as a plain prefix hit (no hint), both heads by
    rank 0, and its tokens are unchanged."""
    writer = engine(tiny, 2, cluster)
    try:
        assert run(writer, [(f"r{i}", p, GREEDY, None)
                            for i, p in enumerate(PROMPTS)]) == reference
        settle(writer)
    finally:
        writer.close()
    reader = engine(tiny, 1, cluster, "consumer")
    try:
        got = run(reader, [(f"r{i}", p, GREEDY, None) for i, p in enumerate(PROMPTS)])
        assert reader.connector.stats.blocks_loaded == STORED
        assert reader.connector.stats.load_failures == 0
        settle(reader)
    finally:
        reader.close()
    assert got == reference


@pytest.mark.parametrize("writer_per_rank", [False, True])
def test_engines_in_different_modes_sharing_a_store_recompute_not_misread(
        tiny, reference, cluster, writer_per_rank):
    """Every engine sharing a store must use one mode; one that does not finds the other
    mode's blocks (the lookup keys are the same) but cannot read them: a per-rank reader
    misses the other heads' objects and reads the whole block under the last head's key,
    whose size and MAC do not fit; a whole-block reader reads the last head's object alone.
    Either way the load fails and the reader recomputes: tokens unchanged, nothing loaded."""
    writer = engine(tiny, 1, cluster, per_rank=writer_per_rank)
    try:
        assert run(writer, [(f"r{i}", p, GREEDY, None)
                            for i, p in enumerate(PROMPTS)]) == reference
        settle(writer)
    finally:
        writer.close()
    reader = engine(tiny, 2 if not writer_per_rank else 1, cluster, "consumer",
                    per_rank=not writer_per_rank)
    try:
        got = run(reader, [(f"r{i}", p, GREEDY, None) for i, p in enumerate(PROMPTS)])
        stats = reader.connector.stats
        assert stats.blocks_loaded == 0 and stats.load_failures >= 1
        settle(reader)
    finally:
        reader.close()
    assert got == reference
