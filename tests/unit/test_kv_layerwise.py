"""Layer-wise streaming (connector/segments.py): a block stored as layer segments, the first
put while the later layers compute; greedy output unchanged, nothing leaks when a segment is
missing, refused, or written by an engine of another segment count."""

import threading

import pytest

from pdserve.common.engine.kv_transfer import KVTransferParams
from pdserve.connector.codec import BlockCodec
from pdserve.connector.segments import LayerSegments
from pdserve.connector.store import InMemoryBlockStore
from tests.unit.test_kv_reuse import (FIRST, GREEDY, QUESTION, TURN1, _req, engine, idle,
                                      reference, run)
from tests.unit.test_kv_reuse import tiny  # noqa: F401 - the module's model fixture

BS = 16
SEG = 2  # the tiny model has 2 layers: one segment each


def _prefill(tiny, store, prompt, **kw):
    p = engine(tiny, store, "producer", layer_segments=SEG, **kw)
    first = run(p, [("r", prompt, FIRST, None, None)])["r"]
    idle(p)
    keys = tuple(p.scheduler.kv.update_block_hashes(_req(prompt)))
    p.close()
    return first, keys


def _decode(tiny, store, prompt, first, keys, segments=SEG):
    d = engine(tiny, store, "consumer", layer_segments=segments)
    rest = run(d, [("r", prompt, GREEDY, first[0], KVTransferParams(block_keys=keys))])["r"]
    idle(d)
    return first + rest, d


def test_segments_geometry_and_keys():
    codec = BlockCodec("ab" * 32, 30, BS, 3, 64)
    seg = LayerSegments(codec, 4)
    assert seg.bounds == (0, 8, 15, 22, 30)
    assert [c.num_layers for c in seg.codecs] == [8, 7, 7, 8]
    assert seg.nbytes == sum(c.nbytes for c in seg.codecs) > codec.nbytes
    key = bytes(32)
    keys = [seg.key(key, s) for s in range(4)]
    assert keys[-1] == key and len(set(keys)) == 4 and all(len(k) == 32 for k in keys)
    assert LayerSegments(codec, 2).key(key, 0) != keys[0]  # bound to the segment count
    assert [seg.ends_at(x) for x in (6, 7, 14, 29)] == [None, 0, 1, 3]
    assert LayerSegments(codec).codecs == (codec,)
    for bad in (0, 31):
        with pytest.raises(ValueError):
            LayerSegments(codec, bad)


def test_layerwise_disagg_equals_unified_and_streams_during_the_forward(tiny):
    """The first segment's puts start before the last layer's save_layer returns (while the
    forward still runs), and decode's output equals a unified engine's."""
    store = InMemoryBlockStore()
    p = engine(tiny, store, "producer", layer_segments=SEG)
    started = threading.Event()
    put, save_layer = store.put, p.connector.save_layer
    layers = []

    async def spy_put(key, data, lease_s=0.0):
        started.set()
        return await put(key, data, lease_s)

    def spy_layer(layer, kv):
        save_layer(layer, kv)
        if layer == SEG - 1 and p.connector._step is not None:  # a step with full blocks
            layers.append(started.wait(10))  # the earlier segment's puts are under way
    store.put, p.connector.save_layer = spy_put, spy_layer
    first = run(p, [("r", TURN1, FIRST, None, None)])["r"]
    idle(p)
    assert layers == [True]
    n = len(TURN1) // BS
    assert len(store.objects) == n * SEG and p.connector.stats.blocks_saved == n
    keys = tuple(p.scheduler.kv.update_block_hashes(_req(TURN1)))
    assert all(k in store.objects for k in keys)
    p.close()
    tokens, d = _decode(tiny, store, TURN1, first, keys)
    assert tokens == reference(tiny, TURN1)
    assert d.connector.stats.blocks_loaded == n and d.connector.stats.load_failures == 0
    d.close()


def test_missing_earlier_segment_stops_the_load_and_recomputes(tiny):
    store = InMemoryBlockStore()
    first, keys = _prefill(tiny, store, TURN1)
    seg = LayerSegments(BlockCodec("ab" * 32, 2, BS, 1, 1), SEG)
    store.objects.pop(seg.key(keys[1], 0))  # evicted: block 1's first layers
    tokens, d = _decode(tiny, store, TURN1, first, keys)
    assert tokens == reference(tiny, TURN1)
    s = d.connector.stats
    assert s.blocks_loaded == 1 and s.load_failures == 1 and s.failure_reasons["miss"] == 1
    d.close()


def test_refused_earlier_segment_never_publishes_the_block(tiny):
    """A failed put of a block's first segment: its own key is never put (a lookup cannot
    find half a block), the prefill answer still comes, and nothing is held."""
    store = InMemoryBlockStore()
    put = store.put
    refused = set()

    async def refuse_first_segments(key, data, lease_s=0.0):
        if len(refused) < 2 and key not in refused:
            refused.add(key)
            return "no_space"
        return await put(key, data, lease_s)
    store.put = refuse_first_segments
    first, keys = _prefill(tiny, store, TURN1)  # idle(): no block, save or budget held
    assert not any(k in store.objects for k in keys[:2]) and keys[2] in store.objects
    store.put = put
    tokens, d = _decode(tiny, store, TURN1, first, keys)
    assert tokens == reference(tiny, TURN1) and d.connector.stats.blocks_loaded == 0
    d.close()


def test_reader_of_another_segment_count_recomputes(tiny):
    store = InMemoryBlockStore()
    first, keys = _prefill(tiny, store, TURN1)
    tokens, d = _decode(tiny, store, TURN1, first, keys, segments=1)
    assert tokens == reference(tiny, TURN1)
    assert d.connector.stats.failure_reasons == {"codec": 1}  # the layer count differs
    d.close()


def test_decode_saves_and_preemption_store_segments_a_later_turn_loads(tiny):
    """Decode's finish-time and preempted saves write segments too; turn 2 on fresh
    instances loads them; cancel and failed saves leave nothing held (idle)."""
    store = InMemoryBlockStore()
    prompts = [TURN1, list(range(60, 109)), list(range(110, 159))]
    d = engine(tiny, store, "consumer", num_blocks=14, layer_segments=SEG)
    store.delay_s = 0.02
    got = run(d, [(f"r{i}", p, GREEDY, None, None) for i, p in enumerate(prompts)])
    assert d.scheduler.num_preemptions > 0
    store.delay_s = 0.0
    idle(d)
    run(d, [("c", TURN1 + QUESTION, GREEDY, None, None)], abort_after="c")
    idle(d)
    put = store.put

    async def broken(key, data, lease_s=0.0):
        raise ConnectionError("node down")
    store.put = broken
    run(d, [("f", list(range(220, 300)), GREEDY, None, None)])
    assert d.connector.stats.save_failures > 0
    idle(d)
    store.put = put
    d.close()
    p = prompts[0]
    assert got["r0"] == reference(tiny, p)
    turn2 = p + got["r0"] + QUESTION
    fresh = engine(tiny, store, "producer", layer_segments=SEG)
    first = run(fresh, [("t", turn2, FIRST, None, None)])["t"]
    assert fresh.connector.stats.blocks_loaded >= len(p) // BS + 1
    assert first == reference(tiny, turn2)[:1]
    idle(fresh)
    fresh.close()


def test_multiturn_breaks_later_turns_ttft_down():
    from pdserve.bench.multiturn import TurnResult, _later_breakdown
    b = {"router_queue_s": 0.01, "prefill_queue_s": 0.5, "prefill_compute_s": 0.25}
    later = [TurnResult(0, 2, 1.0, 100, b),
             TurnResult(1, 2, 2.0, 100, dict(b, prefill_queue_s=1.4)),
             TurnResult(2, 3, 1.5, 100, {})]  # a turn the router reported nothing for
    got = _later_breakdown(later)
    assert got["prefill_queue_s"] == 0.95 and got["prefill_compute_s"] == 0.25
    assert got["rest_s"] == 0.29  # (1.0 - 0.76, 2.0 - 1.66) -> p50
    assert _later_breakdown([TurnResult(0, 2, 1.0, 100, {})]) == {}


def test_multiturn_repeats_report_medians_and_keep_each_run():
    from pdserve.bench.multiturn import summarize_runs

    def run(later_p50, queue, tokens):
        return {"ttft_first_turn_mean_s": 2.0, "ttft_later_mean_s": later_p50,
                "ttft_later_p50_s": later_p50, "ttft_later_p99_s": later_p50 * 2,
                "store_token_share": 0.5, "wall_s": 10.0, "prompt_tokens": tokens,
                "later_breakdown_p50_s": {"prefill_queue_s": queue, "rest_s": 0.1}}
    runs = [run(1.0, 0.3, 900), run(3.0, 0.1, 1000), run(2.0, 0.2, 950)]
    got = summarize_runs(runs)
    assert got["ttft_later_p50_s"] == 2.0 and got["ttft_later_p99_s"] == 4.0
    assert got["prompt_tokens"] == 950
    assert got["later_breakdown_p50_s"] == {"prefill_queue_s": 0.2, "rest_s": 0.1}
    assert got["runs"] == runs
    runs[2]["later_breakdown_p50_s"] = {}  # a part one run lacks is left out
    assert summarize_runs(runs)["later_breakdown_p50_s"] == {}


def test_layer_segments_flag_reaches_the_connector():
    from pdserve.connector.store_connector import ConnectorConfig
    from pdserve.cli import build_parser
    from pdserve.services.engine_host.engine_service_config import EngineServiceConfig

    args = build_parser().parse_args(["serve", "prefill", "--kv-layer-segments", "3"])
    assert args.kv_layer_segments == 3
    cfg = EngineServiceConfig(role="prefill", kv_store="127.0.0.1:1",
                              kv_layer_segments=args.kv_layer_segments)
    assert cfg.kv_settings().connector_config().layer_segments == 3
    for bad in (0, 65):
        with pytest.raises(ValueError):
            ConnectorConfig(layer_segments=bad)


def test_bench_kv_splits_prefill_overhead_by_step_phase():
    from types import SimpleNamespace

    from pdserve.bench.kv import _phases_s, _prefill_report

    def profile(sched, fwd, steps):
        return SimpleNamespace(schedule_ns=sched, forward_ns=fwd, sample_ns=0, update_ns=0,
                               num_steps=steps)
    spent = _phases_s(profile(0, 10**9, 2), profile(10**8, 4 * 10**9, 5))
    assert spent == {"schedule": 0.1, "forward": 3.0, "sample": 0.0, "update": 0.0,
                     "steps": 3}
    got = _prefill_report({2048: [3.0]}, {2048: [0.3]}, {2048: [spent]})["prefill_overhead"]
    assert got["2048"]["overhead_share_of_forward"] == pytest.approx(0.1)
    assert got["2048"]["schedule_s"] == 0.1 and got["2048"]["steps"] == 3


def test_layer_install_equals_block_install_across_head_shards():
    """A load installs its blocks a layer at a time (write_layer_from); the caches end as
    block-by-block installs leave them, with heads split over two ranks."""
    import torch

    from pdserve.connector.layout import HeadShards

    def shards():
        return [[torch.zeros(2, 6, 4, h, 8) for _ in range(3)] for h in (1, 2)]
    blocks = torch.randn(2, 3, 2, 4, 3, 8)  # [n, layers, 2, bs, all heads, d]
    by_block, by_layer = HeadShards(shards()), HeadShards(shards())
    for block_id, block in zip((4, 1), blocks):
        by_block.write_block(block_id, block)
    for layer in range(3):
        by_layer.write_layer_from(blocks[:, layer], layer, torch.tensor([4, 1]))
    for a, b in zip(by_block.shards, by_layer.shards):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(by_layer.read_block(1), blocks[1])
