"""The router's gRPC Generate against a unified tiny engine: tokens equal the offline engine's."""

import grpc
import pytest

from pdserve.common.rpc import engine_pb2 as epb
from pdserve.common.rpc import router_pb2 as pb
from pdserve.common.rpc import router_pb2_grpc as pb_grpc
from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.integration.services_helpers import offline_engine, tiny_stack

GREEDY = epb.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
CHAT = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("logs")) as s:
        with grpc.insecure_channel(s.grpc_addr) as channel:
            yield pb_grpc.RouterStub(channel)


@pytest.fixture(scope="module")
def llm():
    return offline_engine()


def run(stub, **kw):
    msgs = list(stub.Generate(pb.GenerateRequest(params=GREEDY, **kw), timeout=30))
    ids = [t for m in msgs for t in m.token_ids]
    return msgs, ids, "".join(m.text for m in msgs)


def test_generate_text_token_ids_and_chat_match_offline(stub, llm):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = llm.generate("gRPC prompt", params)[0]
    msgs, ids, text = run(stub, text="gRPC prompt")
    assert ids == want.token_ids and text == want.text
    assert msgs[-1].finish_reason == epb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 10
    assert msgs[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    assert all(m.finish_reason == epb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    _, ids2, _ = run(stub, token_ids=pb.TokenIds(ids=want.prompt_token_ids))
    assert ids2 == want.token_ids
    want_chat = llm.chat(CHAT, params)[0]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
    _, ids3, _ = run(stub, chat=chat)
    assert ids3 == want_chat.token_ids


@pytest.mark.parametrize("kw, code", [
    ({}, grpc.StatusCode.INVALID_ARGUMENT),  # no input
    ({"text": "x", "model": "no-such-model"}, grpc.StatusCode.NOT_FOUND),
    ({"text": "x" * 600}, grpc.StatusCode.INVALID_ARGUMENT),  # longer than max_model_len 512
    ({"token_ids": pb.TokenIds(ids=[10**6])}, grpc.StatusCode.INVALID_ARGUMENT),
])
def test_generate_errors(stub, kw, code):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(params=GREEDY, **kw), timeout=30))
    assert info.value.code() == code
    assert info.value.details()


def test_generate_bad_sampling_value(stub):
    bad = epb.SamplingParams(max_tokens=4, temperature=-1)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(text="x", params=bad), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in info.value.details()


def test_health(stub):
    h = stub.Health(pb.RouterHealthRequest(), timeout=5)
    assert h.serving and h.healthy_backends == h.total_backends == 1
