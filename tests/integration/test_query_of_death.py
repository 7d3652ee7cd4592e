"""Query of death: no request kills or wedges an engine. Each bad request goes to a live engine
(the tiny model, in this process) on both services; each is refused with INVALID_ARGUMENT
before anything is queued; then a good request succeeds and Health still says SERVING. A step
that raises anyway fails only its batch, and the engine goes on."""

import asyncio
import math
import threading

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.services.engine_host.engine_server import start_engine_server
from pdserve.services.engine_host.engine_service_config import EngineServiceConfig

PROMPT = [72, 101, 108, 108, 111]
VOCAB = 320  # the tiny model's
MAX_LEN = 256


def _sp(**kw):
    kw.setdefault("max_tokens", 3)
    return pb.SamplingParams(**kw)


# (what is wrong, DecodeRequest fields); each is also sent as a PrefillRequest where it fits
BAD = [
    ("prompt id past the vocabulary", dict(prompt_token_ids=[VOCAB])),
    ("huge prompt id", dict(prompt_token_ids=[2 ** 32 - 1])),
    ("empty prompt", dict(prompt_token_ids=[])),
    ("prompt fills the model", dict(prompt_token_ids=[1] * MAX_LEN)),
    ("stop id past the vocabulary under min_tokens",
     dict(params=_sp(min_tokens=1, stop_token_ids=[1_000_000_000]))),
    ("stop id at the vocabulary", dict(params=_sp(stop_token_ids=[VOCAB]))),
    ("temperature NaN", dict(params=_sp(temperature=math.nan))),
    ("temperature inf", dict(params=_sp(temperature=math.inf))),
    ("top_p NaN", dict(params=_sp(top_p=math.nan))),
    ("repetition_penalty inf", dict(params=_sp(repetition_penalty=math.inf))),
    ("presence_penalty -inf", dict(params=_sp(presence_penalty=-math.inf))),
    ("max_tokens 0", dict(params=_sp(max_tokens=0))),
    ("min_tokens > max_tokens", dict(params=_sp(max_tokens=2, min_tokens=5))),
    ("logprobs huge", dict(params=_sp(logprobs=1_000_000))),
    ("too many stop strings", dict(params=_sp(stop=["s"] * 100))),
    ("a long stop string", dict(params=_sp(stop=["s" * 10_000]))),
    ("an empty stop string", dict(params=_sp(stop=[""]))),
    ("a long cache salt", dict(cache_salt="x" * 10_000)),
    ("a long request id", dict(request_id="r" * 10_000)),
]
BAD_DECODE_ONLY = [
    ("first token past the vocabulary", dict(first_token_id=VOCAB)),
    ("too many block keys", dict(block_keys=[b"k" * 16] * 1000)),
    ("a long block key", dict(block_keys=[b"k" * 1000])),
]


@pytest.fixture(scope="module")
def engine():
    """One live engine for the module, its loop on a thread; the poison runner is installed
    (it only touches requests with the POISON prompt)."""
    torch.set_num_threads(1)
    from pdserve.common.engine.engine_core import EngineCore

    cfg = EngineServiceConfig(role="unified", port=0, model="tiny", num_blocks=64,
                              max_model_len=MAX_LEN)
    core = EngineCore(cfg.engine_config())
    _poison_runner(core)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    running = asyncio.run_coroutine_threadsafe(start_engine_server(cfg, core), loop).result(60)
    try:
        yield f"127.0.0.1:{running.port}"
    finally:
        asyncio.run_coroutine_threadsafe(running.stop(1.0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def serve(address, body):
    async def main():
        async with grpc.aio.insecure_channel(address) as ch:
            return await body(ch)
    return asyncio.run(asyncio.wait_for(main(), 120))


def _decode_req(fields):
    req = dict(request_id="q", prompt_token_ids=PROMPT, params=_sp())
    req.update(fields)
    return pb.DecodeRequest(**req)


def _prefill_req(fields):
    req = dict(request_id="q", prompt_token_ids=PROMPT, params=_sp())
    req.update(fields)
    return pb.PrefillRequest(**req)


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        assert err.details(), err
        return err.code()
    return grpc.StatusCode.OK


async def _decode_all(stub, req):
    return [m async for m in stub.Decode(req, timeout=30)]


async def _settled(ch):
    """GetLoad once nothing runs: the engine publishes its stats just after a step's outputs,
    so the load read right after a request's last message may still count it."""
    stub = pb_grpc.DecodeServiceStub(ch)
    for _ in range(200):
        load = await stub.GetLoad(pb.LoadRequest())
        if load.num_running == 0 and load.num_waiting == 0:
            return load
        await asyncio.sleep(0.025)
    return load


async def _good(ch):
    msgs = await _decode_all(pb_grpc.DecodeServiceStub(ch), _decode_req(
        dict(params=_sp(max_tokens=4, temperature=0, ignore_eos=True))))
    return [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason


def test_every_bad_request_is_refused_and_the_engine_serves_on(engine):
    async def body(ch):
        decode, prefill = pb_grpc.DecodeServiceStub(ch), pb_grpc.PrefillServiceStub(ch)
        codes = {}
        for name, fields in BAD + BAD_DECODE_ONLY:
            codes["decode: " + name] = await _code(_decode_all(decode, _decode_req(fields)))
        for name, fields in BAD:
            codes["prefill: " + name] = await _code(
                prefill.Prefill(_prefill_req(fields), timeout=30))
        tokens, reason = await _good(ch)
        health = await decode.Health(pb.HealthRequest())
        return codes, tokens, reason, health, await _settled(ch)
    codes, tokens, reason, health, load = serve(engine, body)
    wrong = {k: v for k, v in codes.items() if v != grpc.StatusCode.INVALID_ARGUMENT}
    assert not wrong, wrong
    assert len(tokens) == 4 and reason == pb.FINISH_REASON_LENGTH
    assert health.status == pb.HealthResponse.SERVING
    assert load.num_step_failures == 0 and load.num_running == 0
    assert load.num_free_blocks == load.num_total_blocks


POISON = [311, 311, 311]


def _poison_runner(core):
    """A model step that raises (as a sampler bug would) whenever a request with the poison
    prompt is in the batch."""
    execute = core.executor.execute_model

    def guarded(out, layer_done=None):
        poisoned = {rid for rid in (c.request_id for c in out.chunks)
                    if list(core.get_request(rid).prompt_token_ids[:3]) == POISON}
        if poisoned:
            raise IndexError("index 1000000000 is out of bounds for dimension 1 with size 320")
        return execute(out, layer_done)
    core.executor.execute_model = guarded


def test_a_step_that_raises_fails_its_batch_only(engine):
    async def body(ch):
        decode = pb_grpc.DecodeServiceStub(ch)
        failed = []
        for _ in range(2):  # twice: the engine must survive repeated failures
            try:
                await _decode_all(decode, _decode_req(dict(prompt_token_ids=POISON + PROMPT)))
            except grpc.aio.AioRpcError as err:
                failed.append((err.code(), err.details()))
        tokens, reason = await _good(ch)
        health = await decode.Health(pb.HealthRequest())
        return failed, tokens, reason, health, await _settled(ch)
    before = serve(engine, lambda ch: pb_grpc.DecodeServiceStub(ch).GetLoad(pb.LoadRequest()))
    failed, tokens, reason, health, load = serve(engine, body)
    assert len(failed) == 2
    assert all(code == grpc.StatusCode.INTERNAL and "IndexError" in details
               for code, details in failed), failed
    assert len(tokens) == 4 and reason == pb.FINISH_REASON_LENGTH
    assert health.status == pb.HealthResponse.SERVING
    assert load.num_step_failures == before.num_step_failures + 2
    assert load.num_free_blocks == load.num_total_blocks  # the aborted batch gave its blocks back


@pytest.mark.parametrize("rid", ["same", ""])
def test_a_callers_request_id_cannot_collide(engine, rid):
    """Two calls with the same request_id both run: the engine keys requests by its own ids."""
    async def body(ch):
        decode = pb_grpc.DecodeServiceStub(ch)
        req = _decode_req(dict(request_id=rid, params=_sp(max_tokens=4, ignore_eos=True)))
        return await asyncio.gather(_decode_all(decode, req), _decode_all(decode, req))
    a, b = serve(engine, body)
    assert sum(len(m.token_ids) for m in a) == 4 and sum(len(m.token_ids) for m in b) == 4


U32 = st.one_of(st.integers(0, 400), st.sampled_from([2 ** 31, 2 ** 32 - 1]))
DOUBLE = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3))
fuzz_params = st.builds(
    pb.SamplingParams,
    max_tokens=st.one_of(st.integers(0, 6), st.just(2 ** 32 - 1)),
    temperature=DOUBLE, top_p=DOUBLE, top_k=st.integers(-2 ** 31, 2 ** 31 - 1),
    min_p=DOUBLE, seed=st.integers(-2 ** 63, 2 ** 63 - 1), repetition_penalty=DOUBLE,
    presence_penalty=DOUBLE, frequency_penalty=DOUBLE,
    stop=st.lists(st.text(max_size=5), max_size=3), stop_token_ids=st.lists(U32, max_size=3),
    ignore_eos=st.booleans(), logprobs=st.one_of(st.integers(0, 25), st.just(2 ** 32 - 1)),
    min_tokens=st.one_of(st.integers(0, 3), st.just(2 ** 32 - 1)))
FUZZ_FIELDS = dict(  # what DecodeRequest and PrefillRequest share
    request_id=st.text(max_size=8), prompt_token_ids=st.lists(U32, max_size=8),
    params=fuzz_params, block_keys=st.lists(st.binary(max_size=40), max_size=3),
    cache_salt=st.one_of(st.none(), st.text(max_size=8)))
fuzz_decode = st.builds(pb.DecodeRequest, first_token_id=st.one_of(st.none(), U32),
                        **FUZZ_FIELDS)


valid_decode = st.builds(
    pb.DecodeRequest, request_id=st.text(max_size=8),
    prompt_token_ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
    params=st.builds(pb.SamplingParams, max_tokens=st.integers(2, 6),
                     temperature=st.floats(0, 2), top_k=st.integers(0, 50),
                     stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3),
                     min_tokens=st.integers(0, 2), logprobs=st.integers(0, 5),
                     seed=st.integers(-2 ** 63, 2 ** 63 - 1)),
    first_token_id=st.one_of(st.none(), st.integers(0, VOCAB - 1)),
    block_keys=st.lists(st.binary(max_size=40), max_size=2))


def _fuzz_engine(engine, requests, send, max_examples: int) -> dict:
    """Each drawn request sent with `send(channel, request)`: it ends OK or INVALID_ARGUMENT
    (never INTERNAL / UNKNOWN / UNAVAILABLE); then the engine is intact: no step failed since
    before, every block back in the pool, nothing running. The status counts."""
    codes = {}

    async def call(req):
        async with grpc.aio.insecure_channel(engine) as ch:
            return await _code(send(ch, req))

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests)
    def one(req):
        code = asyncio.run(call(req))
        codes[code] = codes.get(code, 0) + 1
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (req, code)

    before = serve(engine, lambda ch: pb_grpc.DecodeServiceStub(ch).GetLoad(pb.LoadRequest()))
    one()
    load = serve(engine, _settled)
    assert load.num_step_failures == before.num_step_failures
    assert load.num_free_blocks == load.num_total_blocks and load.num_running == 0
    return codes


def test_fuzzed_decode_requests_are_served_or_refused(engine):
    """hypothesis (derandomized) over DecodeRequest: each call ends OK or INVALID_ARGUMENT,
    never INTERNAL / UNKNOWN / UNAVAILABLE, and the engine ends intact."""
    codes = _fuzz_engine(engine, st.one_of(fuzz_decode, valid_decode),
                         lambda ch, req: _decode_all(pb_grpc.DecodeServiceStub(ch), req), 120)
    assert codes.get(grpc.StatusCode.OK, 0) >= 5, codes


fuzz_prefill = st.builds(pb.PrefillRequest, **FUZZ_FIELDS)
valid_prefill = st.builds(  # prompts in the vocabulary, small valid sampling, 32-byte keys
    pb.PrefillRequest, prompt_token_ids=st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                 max_size=8),
    params=st.builds(pb.SamplingParams, max_tokens=st.integers(2, 6),
                     temperature=st.floats(0, 2), top_k=st.integers(0, 50)),
    block_keys=st.lists(st.binary(min_size=32, max_size=32), max_size=2))


def test_fuzzed_prefill_requests_are_served_or_refused(engine):
    """hypothesis (derandomized) over PrefillRequest, as the decode fuzz; the engine still
    says SERVING."""
    codes = _fuzz_engine(engine, st.one_of(fuzz_prefill, valid_prefill),
                         lambda ch, req: pb_grpc.PrefillServiceStub(ch).Prefill(req, timeout=30),
                         60)
    assert codes.get(grpc.StatusCode.OK, 0) >= 5 and \
        codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) >= 5, codes
    health = serve(engine, lambda ch: pb_grpc.DecodeServiceStub(ch).Health(pb.HealthRequest()))
    assert health.status == pb.HealthResponse.SERVING
