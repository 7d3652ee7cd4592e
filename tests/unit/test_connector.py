"""KV connector over an in-process store with the tiny model: producer saves, consumer loads,
greedy tokens equal a unified engine's; every load failure becomes a recomputation."""

import asyncio
import time

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.request import RequestStatus
from pdserve.common.models.registry import load_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.connector.codec import HEADER_SIZE, BlockCodec
from pdserve.connector.kvstore.auth import UNKEYED_MAC_KEY, BlockKeys
from pdserve.connector.store import InMemoryBlockStore
from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector
from pdserve.connector.segments import LayerSegments

BS = 16
PROMPTS = [list(range(1, 60)), list(range(100, 140)), [7] * 33]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def engine(tiny, store=None, role=None, mac_key=UNKEYED_MAC_KEY, **conn_kw):
    factory = None
    if store is not None:
        def factory(e):
            c = e.model_config
            codec = BlockCodec(e.fingerprint, c.num_layers, BS, c.num_kv_heads, c.head_dim,
                               mac_key=mac_key)
            return StoreKVConnector(store, codec, ConnectorConfig(role=role, **conn_kw))
    cfg = EngineConfig(model="tiny", num_threads=1, cache=CacheConfig(num_blocks=64,
                       block_size=BS), scheduler=SchedulerConfig(max_model_len=256))
    return EngineCore(cfg, tiny, factory)


def run(core, requests):
    """requests: (rid, prompt, params, first_token) -> {rid: (token ids, finished output)}."""
    for rid, ids, params, first in requests:
        core.add_request(rid, ids, params, first_token_id=first)
    got = {rid: [] for rid, *_ in requests}
    final = {}
    deadline = time.monotonic() + 60
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o
    return got, final


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny):
    got, _ = run(engine(tiny), [(f"r{i}", p, GREEDY, None) for i, p in enumerate(PROMPTS)])
    return got


def prefill_then_decode(tiny, store, decode=None):
    prefill = engine(tiny, store, "producer")
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    got, final = run(prefill, [(f"r{i}", p, first, None) for i, p in enumerate(PROMPTS)])
    assert prefill.num_free_blocks == prefill.num_total_blocks  # held blocks came back
    for i, p in enumerate(PROMPTS):  # finished only once saved: all its blocks are there
        hashes = final[f"r{i}"].block_hashes
        assert len(hashes) == len(p) // BS and all(h in store.objects for h in hashes)
    decode = decode or engine(tiny, store, "consumer")
    out, _ = run(decode, [(f"r{i}", p, GREEDY, got[f"r{i}"][0]) for i, p in enumerate(PROMPTS)])
    prefill.close()
    return {r: got[r] + toks for r, toks in out.items()}, decode


def test_disaggregated_equals_unified(tiny, reference):
    store = InMemoryBlockStore()
    tokens, decode = prefill_then_decode(tiny, store)
    assert tokens == reference
    stats = decode.connector.stats
    assert stats.blocks_loaded == sum(len(p) // BS for p in PROMPTS) and stats.load_failures == 0
    assert decode.stats().num_kv_load_failures == 0
    assert decode.num_free_blocks == decode.num_total_blocks
    decode.close()


def test_store_hit_skips_prefill_on_another_instance(tiny, reference):
    store = InMemoryBlockStore()
    prefill_then_decode(tiny, store)[1].close()
    other = engine(tiny, store, "consumer")  # a different decode instance, no prefill at all
    got, final = run(other, [(f"r{i}", p, GREEDY, None) for i, p in enumerate(PROMPTS)])
    assert got == reference
    assert other.connector.stats.blocks_loaded > 0 and store.gets > 0
    assert store.batch_gets > 0  # one lookup per load, not one per block
    other.close()


@pytest.mark.parametrize("damage", ["corrupt", "delete", "store_down", "wrong_model"])
def test_failed_load_is_recomputed(tiny, reference, damage):
    store = InMemoryBlockStore()
    tokens, d = prefill_then_decode(tiny, store)
    d.close()
    key = sorted(store.objects)[0]
    if damage == "corrupt":
        for k, v in list(store.objects.items()):
            b = bytearray(v)
            b[-5] ^= 0xFF
            store.objects[k] = bytes(b)
    elif damage == "delete":  # evicted between the lookup and the load
        store.objects.pop(key)

        async def stale_lookup(keys):
            return len(keys)
        store.prefix_lookup = stale_lookup
    elif damage == "store_down":
        store.down = True
    decode = engine(tiny, store, "consumer")
    if damage == "wrong_model":
        c = decode.connector.codec
        decode.connector.codec = BlockCodec("ab" * 32, c.num_layers, BS, c.num_kv_heads,
                                            c.head_dim)
        decode.connector.segments = LayerSegments(decode.connector.codec)
    got, _ = run(decode, [(f"r{i}", p, GREEDY, None) for i, p in enumerate(PROMPTS)])
    assert got == reference
    s = decode.connector.stats
    if damage == "store_down":
        assert s.lookup_failures == len(PROMPTS)
    elif damage == "delete":
        assert s.load_failures >= 1 and s.failure_reasons.get("miss", 0) >= 1
    else:
        assert s.load_failures == len(PROMPTS) and s.failure_reasons["codec"] == len(PROMPTS)
    assert decode.num_free_blocks == decode.num_total_blocks
    decode.close()


def test_forged_blocks_are_rejected_and_recomputed(tiny, reference):
    """An attacker who knows the model (its fingerprint is public) but not the block secret
    writes every block first, with its own KV: the engines' keyed MAC rejects each one and
    they recompute, so the tokens stay right."""
    store = InMemoryBlockStore()
    prefill_then_decode(tiny, store)[1].close()  # blocks MAC'd with the public, unkeyed key
    attacker = BlockCodec(*_geometry(tiny), mac_key=UNKEYED_MAC_KEY)
    for k, v in list(store.objects.items()):  # ... and the attacker's KV in them
        forged = bytearray(v)
        forged[HEADER_SIZE:] = bytes(len(forged) - HEADER_SIZE)
        forged[:HEADER_SIZE] = attacker.header(k, memoryview(forged)[HEADER_SIZE:])
        store.objects[k] = bytes(forged)
    secret = BlockKeys.from_secret(b"engine-secret-0123456789").mac
    decode = engine(tiny, store, "consumer", mac_key=secret)
    got, _ = run(decode, [(f"r{i}", p, GREEDY, None) for i, p in enumerate(PROMPTS)])
    assert got == reference
    s = decode.connector.stats
    assert s.failure_reasons["codec"] == len(PROMPTS) and s.blocks_loaded == 0
    decode.close()


def _geometry(tiny):
    e = engine(tiny)
    c = e.model_config
    geo = (e.fingerprint, c.num_layers, BS, c.num_kv_heads, c.head_dim)
    e.close()
    return geo


def test_slow_load_times_out_and_recomputes(tiny, reference):
    store = InMemoryBlockStore()
    prefill_then_decode(tiny, store)[1].close()
    store.delay_s = 1.0
    decode = engine(tiny, store, "consumer", load_timeout_s=0.2)
    got, _ = run(decode, [("r0", PROMPTS[0], GREEDY, None)])
    assert got["r0"] == reference["r0"]
    assert decode.connector.stats.failure_reasons.get("TimeoutError", 0) >= 1
    decode.close()


def test_a_hung_store_lookup_never_blocks_the_engine_thread(tiny, reference):
    """The prefix lookup runs on the connector's I/O thread: while the master does not
    answer, steps return (the request waits) instead of blocking; when it answers, the load
    goes on as usual."""
    store = InMemoryBlockStore()
    prefill_then_decode(tiny, store)[1].close()
    decode = engine(tiny, store, "consumer")
    release = decode.connector.io.run(_make_event(), 5)
    real = store.prefix_lookup

    async def blackholed(keys):
        await release.wait()
        return await real(keys)
    store.prefix_lookup = blackholed
    decode.add_request("r0", PROMPTS[0], GREEDY)
    for _ in range(50):  # would hang here if a step waited for the lookup
        assert decode.step() == []
    assert decode.scheduler.lookup_pending and decode.scheduler.waiting[0].request_id == "r0"
    decode.connector.io.loop.call_soon_threadsafe(release.set)
    got, _ = run(decode, [])
    assert got["r0"] == reference["r0"]
    assert decode.connector.stats.blocks_loaded == len(PROMPTS[0]) // BS
    decode.close()


async def _make_event():
    return asyncio.Event()


def test_cancel_while_waiting_for_kv(tiny):
    store = InMemoryBlockStore()
    prefill_then_decode(tiny, store)[1].close()
    store.delay_s = 0.3
    decode = engine(tiny, store, "consumer")
    decode.add_request("c", PROMPTS[0], GREEDY)
    for _ in range(10_000):  # the first steps wait for the store lookup
        decode.step()
        if "c" in decode.scheduler.kv_waiting:
            break
    req = decode.scheduler.kv_waiting["c"]
    assert req.status == RequestStatus.WAITING_FOR_KV
    decode.abort_request("c")
    assert decode.num_free_blocks < decode.num_total_blocks  # still being written into
    run(decode, [])
    assert req.history[-2:] == [RequestStatus.CANCELLED, RequestStatus.RECLAIMED]
    assert decode.num_free_blocks == decode.num_total_blocks
    decode.close()


def test_producer_backfills_local_hits_missing_from_the_store(tiny, reference):
    store = InMemoryBlockStore()
    prefill = engine(tiny, store, "producer")
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    run(prefill, [("a", PROMPTS[0], first, None)])
    saved = set(store.objects)
    store.objects.clear()  # the store evicted everything; the prefill still caches it locally
    run(prefill, [("b", PROMPTS[0], first, None)])
    assert prefill.stats().prefix_cache_hits > 0
    assert set(store.objects) == saved  # the local hits were written back
    assert prefill.num_free_blocks == prefill.num_total_blocks
    prefill.close()


def test_put_refused_by_the_store_is_a_failure(tiny):
    store = InMemoryBlockStore()

    async def full(key, data, lease_s=0.0):
        return "no_space"
    store.put = full
    prefill = engine(tiny, store, "producer")
    run(prefill, [("a", PROMPTS[0], SamplingParams(max_tokens=1), None)])
    s = prefill.connector.stats
    assert s.blocks_saved == 0 and s.save_failures == len(PROMPTS[0]) // BS
    assert s.failure_reasons["save:no_space"] == len(PROMPTS[0]) // BS
    prefill.close()


def test_consumer_loads_without_prefix_caching(tiny, reference):
    store = InMemoryBlockStore()
    prefill_then_decode(tiny, store)[1].close()

    def factory(e):
        c = e.model_config
        codec = BlockCodec(e.fingerprint, c.num_layers, BS, c.num_kv_heads, c.head_dim)
        return StoreKVConnector(store, codec, ConnectorConfig(role="consumer"))
    cfg = EngineConfig(model="tiny", num_threads=1, cache=CacheConfig(
        num_blocks=64, block_size=BS, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_model_len=256))
    decode = EngineCore(cfg, tiny, factory)
    got, _ = run(decode, [("r0", PROMPTS[0], GREEDY, None)])
    assert got["r0"] == reference["r0"]
    assert decode.connector.stats.blocks_loaded == len(PROMPTS[0]) // BS
    decode.close()


def test_answer_waits_for_the_last_save_not_an_earlier_backfill(tiny):
    """A prompt whose first block is a local hit starts a backfill check at its first chunk;
    when that finishes before the chunk's own save is even submitted, its 'saved' must not
    release the answer while the chunk's blocks are still being put (a decode instance would
    find them missing)."""
    store = InMemoryBlockStore()
    prefill = engine(tiny, store, "producer")
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    shared = list(range(1, 17))  # one full block both prompts start with
    run(prefill, [("a", shared + list(range(30, 50)), first, None)])
    store.delay_s = 0.3  # puts are slow now; the backfill's lookup is not
    _, final = run(prefill, [("b", shared + list(range(60, 80)), first, None)])
    hashes = final["b"].block_hashes
    assert len(hashes) == 2 and all(h in store.objects for h in hashes)
    prefill.close()
