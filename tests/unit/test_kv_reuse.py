"""KV reuse (docs/kv-reuse.md) with the tiny model over an in-process store: prefill loads the
stored prefix, decode saves what its finished requests computed, greedy tokens never change,
and no block, budget or held request leaks on any path."""

import time

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.kv_transfer import KVTransferParams
from pdserve.common.models.registry import load_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.connector.codec import BlockCodec
from pdserve.connector.kvstore.auth import UNKEYED_MAC_KEY
from pdserve.connector.store import InMemoryBlockStore
from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector

BS = 16
TURN1 = list(range(1, 50))  # 3 full blocks
QUESTION = list(range(200, 220))
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def engine(tiny, store=None, role="both", num_blocks=64, **kw):
    factory = None
    if store is not None:
        def factory(e):
            c = e.model_config
            codec = BlockCodec(e.fingerprint, c.num_layers, BS, c.num_kv_heads, c.head_dim,
                               mac_key=UNKEYED_MAC_KEY)
            return StoreKVConnector(store, codec, ConnectorConfig(role=role, **kw))
    cfg = EngineConfig(model="tiny", num_threads=1, cache=CacheConfig(
        num_blocks=num_blocks, block_size=BS), scheduler=SchedulerConfig(max_model_len=256))
    return EngineCore(cfg, tiny, factory)


def run(core, requests, abort_after=None):
    """requests: (rid, prompt, params, first token, kv_transfer) -> {rid: token ids}."""
    for rid, ids, params, first, kvt in requests:
        core.add_request(rid, ids, params, first_token_id=first, kv_transfer=kvt)
    got = {rid: [] for rid, *_ in requests}
    deadline = time.monotonic() + 60
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if abort_after and len(got[abort_after]) >= 3:
                core.abort_request(abort_after)
    return got


def idle(core):
    """Every block back in the pool, no request held, no budget reserved."""
    assert core.num_free_blocks == core.num_total_blocks
    assert not core.scheduler.held and not core.connector._saving
    assert core.connector._budget_used == 0 and not core.connector._store_from


def reference(tiny, prompt, params=GREEDY):
    return run(engine(tiny), [("x", prompt, params, None, None)])["x"]


def disagg(tiny, store, prompt, rid="r", decode=None, kvt=None):
    """Prefill on a fresh producer, decode on `decode` (or a fresh consumer): tokens, prefill."""
    prefill = engine(tiny, store, "producer")
    first = run(prefill, [(rid, prompt, FIRST, None, None)])[rid]
    idle(prefill)
    decode = decode or engine(tiny, store, "consumer")
    keys = KVTransferParams(block_keys=tuple(prefill.scheduler.kv.update_block_hashes(
        _req(prompt))), store_output=kvt is None or kvt)
    rest = run(decode, [(rid, prompt, GREEDY, first[0], keys)])[rid]
    idle(decode)
    prefill.close()
    return first + rest, prefill, decode


def _req(prompt):
    from pdserve.common.engine.request import Request
    return Request("k", prompt, GREEDY, GREEDY.max_tokens)


def test_prefill_loads_a_partial_store_hit_and_computes_the_rest(tiny):
    store = InMemoryBlockStore()
    other = TURN1[:32] + list(range(250, 280))  # shares 2 blocks with TURN1
    want = reference(tiny, other)
    a = engine(tiny, store, "producer")
    run(a, [("a", TURN1, FIRST, None, None)])
    b = engine(tiny, store, "producer")  # another prefill instance: nothing cached locally
    first = run(b, [("b", other, FIRST, None, None)])["b"]
    assert b.connector.stats.blocks_loaded == 2 and b.connector.stats.load_failures == 0
    assert first == want[:1]
    idle(b)
    assert len(store.objects) == 3 + 1  # b saved only the block it computed
    for c in (a, b):
        c.close()


def test_turn_two_of_a_chat_loads_turn_ones_answer_from_another_decode(tiny):
    store = InMemoryBlockStore()
    turn1, _, d1 = disagg(tiny, store, TURN1)
    assert turn1 == reference(tiny, TURN1)
    # decode saved the answer's full blocks (its last token's KV was never computed)
    n_full = (len(TURN1) + len(turn1) - 1) // BS
    assert d1.connector.stats.blocks_saved == n_full - len(TURN1) // BS
    d1.close()
    turn2 = TURN1 + turn1 + QUESTION
    p2 = engine(tiny, store, "producer")  # turn 2 on instances that never saw turn 1
    first = run(p2, [("t2", turn2, FIRST, None, None)])["t2"]
    assert p2.connector.stats.blocks_loaded == n_full
    assert first == reference(tiny, turn2)[:1]
    idle(p2)
    p2.close()


def test_opted_out_request_saves_nothing(tiny):
    store = InMemoryBlockStore()
    _, _, d = disagg(tiny, store, TURN1, kvt=False)
    assert d.connector.stats.blocks_saved == 0
    d.close()


# failure -> blocks of the 3 stored that load before it (None: the lookup itself failed)
LOAD_FAILURES = {"lookup_down": None, "down": 0, "first_evicted": 0, "middle_evicted": 1,
                 "last_corrupt": 2, "timeout": 0}


@pytest.mark.parametrize("failure", sorted(LOAD_FAILURES))
def test_store_failure_at_any_point_of_a_prefill_load_recomputes(tiny, failure):
    """The store fails at each point of a prefill's load of a 3-block stored prefix: the
    blocks before the failure are used, the rest recomputed, the token is unchanged."""
    store = InMemoryBlockStore()
    run(engine(tiny, store, "producer"), [("a", TURN1, FIRST, None, None)])
    p = engine(tiny, store, "producer", load_timeout_s=0.2)
    lookup = store.prefix_lookup

    async def then_fail(keys):  # the lookup answers; the load that follows fails
        if failure == "lookup_down":
            raise ConnectionError("store is down")
        n = await lookup(keys)
        if failure == "down":
            store.down = True
        elif failure.endswith("evicted"):
            store.objects.pop(keys[0 if failure == "first_evicted" else 1])
        elif failure == "last_corrupt":
            data = bytearray(store.objects[keys[2]])
            data[-1] ^= 0x40  # one payload bit: the block's MAC no longer matches
            store.objects[keys[2]] = bytes(data)
        elif failure == "timeout":
            store.delay_s = 1.0
        store.prefix_lookup = lookup
        return n
    store.prefix_lookup = then_fail
    first = run(p, [("p", TURN1 + QUESTION, FIRST, None, None)])["p"]
    store.down, store.delay_s = False, 0.0
    assert first == reference(tiny, TURN1 + QUESTION)[:1]
    loaded = LOAD_FAILURES[failure]
    stats = p.connector.stats
    if loaded is None:
        assert stats.lookup_failures == 1 and stats.load_failures == 0
        assert stats.blocks_loaded == 0
    else:
        assert stats.load_failures == 1 and stats.blocks_loaded == loaded
        assert p.scheduler.num_load_failures == 1
    if failure == "last_corrupt":
        assert stats.failure_reasons.get("codec") == 1
    idle(p)
    p.close()


def test_decode_saves_racing_eviction_and_preemption(tiny):
    """Slow puts while a small pool evicts and preempts: the saved blocks stay held until
    they are put, so what is stored is what was computed (a fresh instance reuses it)."""
    store = InMemoryBlockStore()
    prompts = [TURN1, list(range(60, 109)), list(range(110, 159))]
    d = engine(tiny, store, "consumer", num_blocks=14)  # cannot hold all three answers
    store.delay_s = 0.05
    got = run(d, [(f"r{i}", p, GREEDY, None, None) for i, p in enumerate(prompts)])
    assert d.scheduler.num_preemptions > 0
    store.delay_s = 0.0
    idle(d)
    d.close()
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == reference(tiny, p)
        turn2 = p + got[f"r{i}"] + QUESTION
        fresh = engine(tiny, store, "producer")
        first = run(fresh, [("t", turn2, FIRST, None, None)])["t"]
        assert fresh.connector.stats.blocks_loaded >= len(p) // BS + 1
        assert first == reference(tiny, turn2)[:1]
        fresh.close()


def test_decode_saves_a_block_as_soon_as_it_fills(tiny):
    """A chat client sends the next turn the moment an answer ends: the answer's blocks must
    not wait for the request to finish. Here the engine stops stepping mid-answer, and the
    blocks that filled so far reach the store anyway."""
    store = InMemoryBlockStore()
    d = engine(tiny, store, "consumer")
    long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    d.add_request("r", TURN1, long)
    req = d.scheduler.requests["r"]
    while req.num_computed_tokens < 4 * BS + 2:  # the prompt's 3 blocks and one answer block
        d.step()
    assert d.has_unfinished_requests()
    want = req.block_hashes[:4]
    deadline = time.monotonic() + 10
    while not all(k in store.objects for k in want):
        assert time.monotonic() < deadline, "the filled blocks were not saved mid-answer"
        time.sleep(0.01)
    d.abort_request("r")
    while d.has_unfinished_requests():
        d.step()
    saved = d.connector.stats.blocks_saved
    assert saved >= 4  # the cancel saves nothing more, but what filled before it stays
    idle(d)
    d.close()


def test_no_leak_after_cancel_failed_save_or_budget(tiny):
    store = InMemoryBlockStore()
    _, _, d = disagg(tiny, store, TURN1)
    d.close()
    d = engine(tiny, store, "consumer", save_budget_bytes=1)  # not one block fits
    run(d, [("b", TURN1 + QUESTION, GREEDY, None, None)])
    # over budget in the step that computed the prompt's 4 blocks and the one the answer filled
    assert d.connector.stats.saves_over_budget == 2 and d.connector.stats.blocks_saved == 0
    idle(d)
    d.close()
    d = engine(tiny, store, "consumer")
    run(d, [("c", list(range(150, 200)), GREEDY, None, None)], abort_after="c")
    # a cancelled request saves nothing more: only the prompt's 3 blocks, filled before it
    assert d.connector.stats.blocks_saved == 3
    idle(d)
    put = store.put

    async def broken(key, data, lease_s=0.0):
        raise ConnectionError("node down")
    store.put = broken
    run(d, [("f", TURN1 + QUESTION + [9] * 20, GREEDY, None, None)])
    assert d.connector.stats.save_failures > 0
    idle(d)
    store.put = put
    d.close()


def test_kv_reuse_switch_reaches_the_connector():
    from pdserve.services.engine_host.engine_service_config import EngineServiceConfig

    for on in (True, False):
        cfg = EngineServiceConfig(role="prefill", kv_store="127.0.0.1:1", kv_reuse=on)
        assert cfg.kv_settings().connector_config().reuse is on
    with pytest.raises(ValueError):
        ConnectorConfig(save_budget_bytes=-1)


def test_multiturn_workload_keeps_user_turns_in_order(tmp_path):
    import json

    from pdserve.bench.multiturn_workload import pick_conversations

    def conv(n):
        return {"conversations": [t for k in range(n) for t in (
            {"from": "human", "value": f"q{k}" * 50}, {"from": "gpt", "value": "a"})]}
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([conv(1), conv(3), conv(4), conv(2)]))
    picked = pick_conversations(2, 3, 10, seed=0, path=path)
    assert [c.index for c in picked] == [1, 2]
    assert picked[0].user_turns == ("q0" * 5, "q1" * 5, "q2" * 5)
    with pytest.raises(ValueError):
        pick_conversations(3, 3, 10, seed=0, path=path)


def test_prefill_trusts_the_routers_stored_keys_without_a_lookup(tiny):
    store = InMemoryBlockStore()
    run(engine(tiny, store, "producer"), [("a", TURN1, FIRST, None, None)])
    keys = tuple(store.objects)  # what the router's lookup found (any order is a miss)
    hint = KVTransferParams(block_keys=tuple(engine(tiny).scheduler.kv.update_block_hashes(
        _req(TURN1))))
    assert set(hint.block_keys) == set(keys)
    lookups = []
    lookup = store.prefix_lookup

    async def counted(k):
        lookups.append(len(k))
        return await lookup(k)
    store.prefix_lookup = counted
    p = engine(tiny, store, "producer")
    first = run(p, [("p", TURN1 + QUESTION, FIRST, None, hint)])["p"]
    assert first == reference(tiny, TURN1 + QUESTION)[:1]
    assert p.connector.stats.blocks_loaded == 3 and lookups == []
    idle(p)
    p.close()


def test_cancel_while_prefill_loads_leaks_nothing(tiny):
    store = InMemoryBlockStore()
    run(engine(tiny, store, "producer"), [("a", TURN1, FIRST, None, None)])
    store.delay_s = 0.3
    p = engine(tiny, store, "producer")
    p.add_request("c", TURN1 + QUESTION, FIRST)
    deadline = time.monotonic() + 30
    while "c" not in p.scheduler.kv_waiting:
        assert time.monotonic() < deadline
        p.step()
    p.abort_request("c")
    run(p, [])
    idle(p)
    p.close()
