"""Store failures in a disaggregated stack of real processes (tiny model): a corrupted block,
deleted keys, Redis stopped, the storage node killed, the prefill instance killed. Each test
injects its failure on top of the previous ones (as failures pile up in production) and
asserts every request still completes with the offline engine's greedy tokens, and that the
counter for that fallback moved. Each test uses its own prompt, so no instance can answer from
its local prefix cache instead of the store."""

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.integration.disagg_helpers import (decode_direct, disagg_stack, engine_load,
                                                      generate, metric, prefill_direct,
                                                      store_call)
from pdserve.tests.integration.services_helpers import offline_engine, wait_pool_whole

MAX_TOKENS = 8
PROMPTS = {name: [(7 * i + k) % 250 + 3 for i in range(50 + 3 * k)]  # 3-4 full blocks each
           for k, name in enumerate(["corrupt", "delete", "redis", "node", "node2", "prefill"])}


@pytest.fixture(scope="module")
def ref():
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = offline_engine().generate(list(PROMPTS.values()), params)
    return {name: o.token_ids for name, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with disagg_stack(tmp_path_factory.mktemp("kvfail"), n_decode=1) as s:
        yield s


def hand_off(stack, name):
    """Prefill directly (its blocks are stored when it answers); (first token, keys)."""
    first = prefill_direct(stack.prefill[0], PROMPTS[name], MAX_TOKENS)
    assert len(first.block_keys) == len(PROMPTS[name]) // 16
    return first.first_token_id, list(first.block_keys)


def decode_after(stack, name, first, keys):
    return [first] + decode_direct(stack.decode[0], PROMPTS[name], MAX_TOKENS,
                                   first_token_id=first, block_keys=keys)


def test_corrupted_block_is_rejected_and_recomputed(stack, ref):
    first, keys = hand_off(stack, "corrupt")

    async def corrupt(kv):
        data = bytearray(await kv.get(keys[1]))
        data[-7] ^= 0x5A  # one payload byte: only the checksum can tell
        assert await kv.remove([keys[1]], force=True) == 1
        await kv.put(keys[1], bytes(data), lease_s=60)
    store_call(stack.master_addr, corrupt)
    before = engine_load(stack.decode[0])
    assert decode_after(stack, "corrupt", first, keys) == ref["corrupt"]
    after = engine_load(stack.decode[0])
    assert after.kv.failure_reasons["codec"] == before.kv.failure_reasons.get("codec", 0) + 1
    assert after.kv.blocks_loaded - before.kv.blocks_loaded == 1  # the block before it
    assert after.num_kv_load_failures == before.num_kv_load_failures + 1


def test_deleted_keys_are_recomputed(stack, ref):
    first, keys = hand_off(stack, "delete")
    assert store_call(stack.master_addr, lambda kv: kv.remove(keys, force=True)) == len(keys)
    before = engine_load(stack.decode[0])
    assert decode_after(stack, "delete", first, keys) == ref["delete"]
    after = engine_load(stack.decode[0])
    assert after.kv.failure_reasons["miss"] > before.kv.failure_reasons.get("miss", 0)
    assert after.kv.blocks_loaded == before.kv.blocks_loaded
    # through the router too: nothing stored, so prefill runs again; same tokens
    assert generate(stack.grpc_addr, PROMPTS["delete"], MAX_TOKENS)[0] == ref["delete"]


def test_redis_stopped(stack, ref):
    stack.redis.stop()
    tokens, _ = generate(stack.grpc_addr, PROMPTS["redis"], MAX_TOKENS)
    assert tokens == ref["redis"]
    pre = engine_load(stack.prefill[0], "prefill")
    assert pre.kv.save_failures > 0  # the master could not record the new blocks


def test_storage_node_killed(stack, ref):
    first, keys = hand_off(stack, "node")
    stack.kill("kv-node")
    before = engine_load(stack.decode[0])
    assert decode_after(stack, "node", first, keys) == ref["node"]
    after = engine_load(stack.decode[0])
    assert after.num_kv_load_failures == before.num_kv_load_failures + 1
    assert generate(stack.grpc_addr, PROMPTS["node2"], MAX_TOKENS)[0] == ref["node2"]


def test_prefill_killed_falls_back_to_decode(stack, ref):
    stack.kill("prefill0")
    tokens, _ = generate(stack.grpc_addr, PROMPTS["prefill"], MAX_TOKENS)
    assert tokens == ref["prefill"]
    assert metric(stack.http_url, "pdserve_router_prefill_fallbacks_total") >= 1
    load = wait_pool_whole(stack.decode[0])  # decode's own KV saves hold blocks until put
    assert load.num_free_blocks == load.num_total_blocks  # nothing leaked on any path
