"""KV blocks in the store carry their cache dtype (`--kv-cache-dtype`): engines of one half
dtype hand blocks over as in fp32, and a block written in one dtype is never read as another:
the reader refuses it (codec failure, logged) and recomputes, so its tokens stay its own."""

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.models.registry import load_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.connector.codec import BlockCodec
from pdserve.connector.store import InMemoryBlockStore
from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector
from tests.unit.test_connector import BS, GREEDY, PROMPTS, run


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def engine(tiny, kv_dtype: str, store=None, role=None):
    factory = None
    if store is not None:
        def factory(e):
            c = e.model_config
            codec = BlockCodec(e.fingerprint, c.num_layers, BS, c.num_kv_heads, c.head_dim,
                               dtype=e.kv_dtype)
            return StoreKVConnector(store, codec, ConnectorConfig(role=role))
    cfg = EngineConfig(model="tiny", num_threads=1, kv_cache_dtype=kv_dtype,
                       cache=CacheConfig(num_blocks=64, block_size=BS),
                       scheduler=SchedulerConfig(max_model_len=256))
    return EngineCore(cfg, tiny, factory)


def unified(tiny, kv_dtype):
    e = engine(tiny, kv_dtype)
    assert all(c.dtype == e.kv_dtype for c in e.executor.runner.kv_caches)
    got, _ = run(e, [(f"r{i}", p, GREEDY, None) for i, p in enumerate(PROMPTS)])
    e.close()
    return got


def disaggregated(tiny, store, producer_dtype, consumer_dtype):
    prefill = engine(tiny, producer_dtype, store, "producer")
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    got, _ = run(prefill, [(f"r{i}", p, first, None) for i, p in enumerate(PROMPTS)])
    prefill.close()
    decode = engine(tiny, consumer_dtype, store, "consumer")
    out, _ = run(decode, [(f"r{i}", p, GREEDY, got[f"r{i}"][0]) for i, p in enumerate(PROMPTS)])
    return {r: got[r] + toks for r, toks in out.items()}, decode


def test_half_cache_blocks_round_trip_through_the_store(tiny):
    store = InMemoryBlockStore()
    tokens, decode = disaggregated(tiny, store, "bfloat16", "bfloat16")
    assert tokens == unified(tiny, "bfloat16")
    s = decode.connector.stats
    assert s.blocks_loaded == sum(len(p) // BS for p in PROMPTS) and s.load_failures == 0
    # half the bytes of an fp32 block's payload
    fp32 = BlockCodec(decode.fingerprint, decode.model_config.num_layers, BS,
                      decode.model_config.num_kv_heads, decode.model_config.head_dim)
    assert decode.connector.codec.payload_nbytes * 2 == fp32.payload_nbytes
    decode.close()


def test_a_block_of_another_dtype_is_refused_and_recomputed(tiny):
    store = InMemoryBlockStore()
    tokens, decode = disaggregated(tiny, store, "bfloat16", "float32")
    # the first token came from the bf16 prefill; the rest are the fp32 engine's own, computed
    # from a prompt it recomputed (an fp32 engine given the same first token)
    reference = unified(tiny, "float32")
    assert {r: t[1:] for r, t in tokens.items()} == {r: t[1:] for r, t in reference.items()}
    s = decode.connector.stats
    assert s.blocks_loaded == 0
    assert s.load_failures == len(PROMPTS) and s.failure_reasons["codec"] == len(PROMPTS)
    assert decode.num_free_blocks == decode.num_total_blocks
    decode.close()
