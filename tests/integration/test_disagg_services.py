"""Prefill and decode engine services with a real KV store (redis, master, node), all in this
process on free ports: the hand-off through the store gives the offline engine's greedy tokens,
and the block keys a router computes from Health equal the ones prefill stored."""

import asyncio
import contextlib

import grpc
import pytest
import torch

from pdserve.common.kv.block_hash import chain_seed, hash_blocks
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_host.engine_server import build_core, start_engine_server
from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
from pdserve.services.kvstore.config import MasterConfig, NodeConfig
from pdserve.services.kvstore.master_service import start_master
from pdserve.services.kvstore.node import start_node
from pdserve.tests.integration.services_helpers import offline_engine

PROMPT = list(range(3, 53))  # 50 tokens: 3 full blocks of 16 and a tail of 2
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference():
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return offline_engine().generate([PROMPT], params)[0].token_ids


@contextlib.asynccontextmanager
async def kv_store(redis_url: str):
    master = await start_master(MasterConfig(port=0, redis_url=redis_url))
    node = None
    try:
        node = await start_node(NodeConfig(master_addr=f"127.0.0.1:{master.port}",
                                           capacity=16 << 20, transport="tcp"))
        yield f"127.0.0.1:{master.port}"
    finally:
        if node is not None:
            await node.stop()
        await master.stop(0.5)


@contextlib.asynccontextmanager
async def engine(role: str, store: str):
    cfg = EngineServiceConfig(role=role, port=0, model="tiny", num_blocks=64,
                              max_model_len=256, kv_store=store, kv_transport="tcp")
    core = await asyncio.get_running_loop().run_in_executor(None, build_core, cfg)
    running = await start_engine_server(cfg, core)
    assert await running.engine.wait_warmed_up()  # SERVING after warm-up
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            yield ch
    finally:
        await running.stop(0.5)


def greedy(**kw):
    return pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kw)


async def decode_tokens(ch, **req):
    msgs = [m async for m in pb_grpc.DecodeServiceStub(ch).Decode(pb.DecodeRequest(
        prompt_token_ids=PROMPT, params=greedy(), **req))]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return [t for m in msgs for t in m.token_ids]


async def load_when_whole(ch, timeout_s: float = 10.0):
    """GetLoad once every block is free again, or at the deadline. A decode instance keeps a
    finished request's blocks until its saves of them (KV reuse) are put, which runs on the
    connector's I/O worker after the stream ended: a leak still fails the caller's check."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        load = await pb_grpc.DecodeServiceStub(ch).GetLoad(pb.LoadRequest())
        if load.num_free_blocks == load.num_total_blocks \
                or asyncio.get_running_loop().time() > deadline:
            return load
        await asyncio.sleep(0.02)


def test_prefill_saves_decode_loads_same_tokens(reference, redis_url):
    torch.set_num_threads(1)

    async def main(redis_url):
        async with kv_store(redis_url) as store, engine("prefill", store) as pre, \
                engine("decode", store) as dec, engine("decode", store) as other:
            health = await pb_grpc.PrefillServiceStub(pre).Health(pb.HealthRequest())
            assert (health.kv_role, health.block_size) == ("producer", 16)
            first = await pb_grpc.PrefillServiceStub(pre).Prefill(
                pb.PrefillRequest(request_id="p", prompt_token_ids=PROMPT, params=greedy()))
            rest = await decode_tokens(dec, request_id="d", first_token_id=first.first_token_id,
                                       block_keys=first.block_keys)
            hit = await decode_tokens(other, request_id="h", block_keys=first.block_keys)
            loads = [await load_when_whole(c) for c in (dec, other)]
            saved = await pb_grpc.PrefillServiceStub(pre).GetLoad(pb.LoadRequest())
            return health, first, rest, hit, loads, saved

    health, first, rest, hit, loads, saved = asyncio.run(
        asyncio.wait_for(main(redis_url), 120))
    seed = chain_seed(health.model_fingerprint, health.block_size)
    assert list(first.block_keys) == hash_blocks(seed, PROMPT, 16)  # what a router computes
    assert [first.first_token_id] + rest == reference
    assert hit == reference  # another instance, no prefill: the store served the prompt
    assert saved.kv.blocks_saved == 3 and saved.kv.save_failures == 0
    for load in loads:
        assert load.kv.blocks_loaded == 3 and load.kv.bytes_loaded > 0
        assert load.kv.load_failures == 0 and load.num_kv_load_failures == 0
        assert load.num_free_blocks == load.num_total_blocks


def test_decode_without_store_recomputes_the_hand_off(reference):
    """No store at all: a first token and keys nobody stored still give the same tokens, and a
    first token with max_tokens < 2 is refused as bad input."""
    torch.set_num_threads(1)

    async def main():
        async with engine("decode", "") as dec:
            rest = await decode_tokens(dec, first_token_id=reference[0],
                                       block_keys=[b"k" * 32, b"j" * 32])
            try:
                [m async for m in pb_grpc.DecodeServiceStub(dec).Decode(pb.DecodeRequest(
                    prompt_token_ids=PROMPT, first_token_id=reference[0],
                    params=pb.SamplingParams(max_tokens=1)))]
            except grpc.aio.AioRpcError as err:
                return rest, err
            raise AssertionError("max_tokens=1 with a first token should be refused")

    rest, err = asyncio.run(asyncio.wait_for(main(), 60))
    assert [reference[0]] + rest == reference
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in err.details()
