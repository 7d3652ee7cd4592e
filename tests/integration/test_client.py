"""pdserve.client (blocking and asyncio) against a tiny router and engine: the typed results
carry what the raw Router stub returns; refusals become ClientError; leaving a stream early
cancels the request on the engine."""

import asyncio
import time

import grpc
import pytest

from pdserve.client import (AsyncClient, ChatMessage, Client, ClientError, FinishReason,
                            Sampling)
from pdserve.common.rpc import engine_pb2 as epb
from pdserve.common.rpc import router_pb2 as pb
from pdserve.common.rpc import router_pb2_grpc as pb_grpc
from pdserve.tests.integration.inproc_stack import inproc_stack
from pdserve.tests.integration.services_helpers import engine_load

GREEDY = Sampling(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack():
    with inproc_stack() as s:
        yield s


def raw_ids(address: str, text: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        req = pb.GenerateRequest(text=text, params=epb.SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True))
        return [t for m in pb_grpc.RouterStub(channel).Generate(req, timeout=30)
                for t in m.token_ids]


def test_sync_client_generate_stream_chat_and_errors(stack):
    want = raw_ids(stack.router_grpc, "client prompt")
    with Client(stack.router_grpc, timeout_s=30) as c:
        out = c.generate("client prompt", sampling=GREEDY)
        assert list(out.token_ids) == want
        assert out.finish_reason is FinishReason.LENGTH
        assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0
        chunks = list(c.stream("client prompt", sampling=GREEDY))
        assert [t for ch in chunks for t in ch.token_ids] == want
        assert all(ch.finish_reason is None for ch in chunks[:-1])
        assert "".join(ch.text for ch in chunks) == out.text
        by_ids = c.generate(token_ids=list(out.token_ids[:4]), sampling=GREEDY)
        assert len(by_ids.token_ids) == 12
        chat = c.generate(messages=[ChatMessage("user", "hi"), {"role": "user",
                                                                "content": "again"}],
                          sampling=Sampling(max_tokens=3, temperature=0, logprobs=2))
        assert len(chat.logprobs) == 3 and all(len(lp.top) == 2 for lp in chat.logprobs)
        health = c.health()
        assert health.serving and health.healthy_backends == 1
        with pytest.raises(ClientError) as info:
            c.generate(token_ids=[10**6], sampling=GREEDY)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ClientError) as info:
            c.generate("x", model="no-such-model")
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ValueError):
            c.generate("x", token_ids=[1])


def test_leaving_a_stream_early_cancels_it_on_the_engine(stack):
    with Client(stack.router_grpc, timeout_s=30) as c:
        stream = c.stream("a long one", sampling=Sampling(max_tokens=200, temperature=0,
                                                          ignore_eos=True))
        next(stream)
        stream.close()  # what a `break` out of the for loop does
    deadline = time.monotonic() + 10
    while engine_load(stack.engine_addr).num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    load = engine_load(stack.engine_addr)
    assert load.num_running == 0 and load.num_aborted >= 1


def test_async_client_matches_the_sync_one(stack):
    want = raw_ids(stack.router_grpc, "async prompt")

    async def main():
        async with AsyncClient(stack.router_grpc, timeout_s=30) as c:
            outs = await asyncio.gather(*(c.generate("async prompt", sampling=GREEDY)
                                          for _ in range(3)))
            chunks = [ch async for ch in c.stream("async prompt", sampling=GREEDY)]
            health = await c.health()
            with pytest.raises(ClientError) as info:
                await c.generate(token_ids=[10**6])
            return outs, chunks, health, info.value.code

    outs, chunks, health, code = asyncio.run(main())
    assert all(list(o.token_ids) == want for o in outs)
    assert [t for ch in chunks for t in ch.token_ids] == want
    assert chunks[-1].finish_reason is FinishReason.LENGTH and chunks[-1].usage is not None
    assert health.serving
    assert code == grpc.StatusCode.INVALID_ARGUMENT
