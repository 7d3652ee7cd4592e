"""The engine instance's gRPC services, in this process, around a real tiny EngineCore."""

import asyncio

import grpc
import pytest
import torch

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_host.engine_server import start_engine_server
from pdserve.services.engine_host.engine_service_config import EngineServiceConfig
from pdserve.tests.integration.services_helpers import offline_engine

PROMPT = [72, 101, 108, 108, 111, 32, 119]


def serve(role: str, body):
    torch.set_num_threads(1)
    from pdserve.common.engine.engine_core import EngineCore

    cfg = EngineServiceConfig(role=role, port=0, model="tiny", num_blocks=64,
                              max_model_len=256)

    async def main():
        running = await start_engine_server(cfg, EngineCore(cfg.engine_config()))
        assert await running.engine.wait_warmed_up()  # SERVING after warm-up
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
                return await body(ch)
        finally:
            await running.stop(1.0)
    return asyncio.run(main())


def test_unified_decode_and_prefill_match_offline():
    want = offline_engine().generate([PROMPT], SamplingParams(max_tokens=8, temperature=0,
                                                              ignore_eos=True))[0]

    async def body(ch):
        params = pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
        msgs = [m async for m in pb_grpc.DecodeServiceStub(ch).Decode(
            pb.DecodeRequest(request_id="d", prompt_token_ids=PROMPT, params=params))]
        first = await pb_grpc.PrefillServiceStub(ch).Prefill(
            pb.PrefillRequest(request_id="p", prompt_token_ids=PROMPT, params=params))
        health = await pb_grpc.DecodeServiceStub(ch).Health(pb.HealthRequest())
        load = await pb_grpc.DecodeServiceStub(ch).GetLoad(pb.LoadRequest())
        return msgs, first, health, load.profile
    msgs, first, health, prof = serve("unified", body)
    # the served-path profile: 8 decode steps' phases, the prefill's step, the messages sent
    assert prof.num_steps >= 9 and prof.num_sampled >= 9 and prof.num_tokens >= 2 * 7 + 7
    assert prof.num_messages == len(msgs) - 1  # every streamed message after "accepted"
    assert min(prof.forward_ns, prof.sample_ns, prof.update_ns, prof.handoff_ns,
               prof.deliver_ns, prof.send_ns) > 0
    assert not msgs[0].token_ids and msgs[0].finish_reason == 0  # the "accepted" message
    assert [t for m in msgs for t in m.token_ids] == want.token_ids
    assert sum(len(m.logprobs) for m in msgs) == 8
    assert all(len(lp.top) == 2 for m in msgs for lp in m.logprobs)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].timings.e2e_s > 0
    assert first.first_token_id == want.token_ids[0]
    assert first.finish_reason == pb.FINISH_REASON_UNSPECIFIED  # decode would go on
    assert first.num_prompt_tokens == len(PROMPT) and len(first.logprob.top) == 2
    assert (health.role, health.max_model_len, health.model) == ("unified", 256, "tiny")


@pytest.mark.parametrize("role, service, code", [
    ("prefill", "decode", grpc.StatusCode.UNIMPLEMENTED),  # a prefill instance has no Decode
    ("decode", "prefill", grpc.StatusCode.UNIMPLEMENTED),
    ("unified", "bad", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_refusals(role, service, code):
    async def body(ch):
        params = pb.SamplingParams(max_tokens=4)
        try:
            if service == "prefill":
                await pb_grpc.PrefillServiceStub(ch).Prefill(
                    pb.PrefillRequest(prompt_token_ids=PROMPT, params=params))
            else:
                req = pb.DecodeRequest(prompt_token_ids=PROMPT, params=params)
                if service == "bad":
                    req.prompt_token_ids.append(10 ** 6)
                [m async for m in pb_grpc.DecodeServiceStub(ch).Decode(req)]
        except grpc.aio.AioRpcError as err:
            return err
        raise AssertionError("the call should have failed")
    err = serve(role, body)
    assert err.code() == code and err.details()
