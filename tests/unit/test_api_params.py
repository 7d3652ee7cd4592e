"""The request fields added for the OpenAI API at the engine's edge: structured_output and
logit_bias survive the proto round trip, are bounded by SamplingParams and the engine's gRPC
edge, and logit_bias moves the sampler as OpenAI specifies."""

import pytest
import torch

from pdserve.common.engine.request import Request
from pdserve.common.engine.sampler import Sampler
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from pdserve.common.structured_output import StructuredKind as K
from pdserve.common.structured_output import StructuredOutput
from pdserve.services.common.convert import (EngineLimits, check_engine_request,
                                             params_from_proto, params_to_proto,
                                             structured_from_proto)

SPECS = [StructuredOutput(K.JSON_OBJECT), StructuredOutput(K.JSON_SCHEMA, '{"type": "string"}'),
         StructuredOutput(K.REGEX, "[a-z]+"), StructuredOutput(K.CHOICE, choices=("a", 'b"')),
         StructuredOutput(K.GRAMMAR, 'root ::= "x" | "y"')]


@pytest.mark.parametrize("spec", SPECS, ids=[s.kind.value for s in SPECS])
def test_structured_output_and_logit_bias_round_trip_the_proto(spec):
    p = SamplingParams(temperature=0, structured_output=spec, logit_bias={7: 5.5, 3: -100})
    msg = params_to_proto(p)
    assert msg.structured_output.WhichOneof("constraint") == spec.kind.value
    back = params_from_proto(pb.SamplingParams.FromString(msg.SerializeToString()))
    assert back == p and back.logit_bias == ((3, -100.0), (7, 5.5))


def test_bad_structured_messages_are_value_errors():
    with pytest.raises(ValueError, match="one constraint"):
        structured_from_proto(pb.StructuredOutput())
    with pytest.raises(ValueError, match="valid JSON"):
        structured_from_proto(pb.StructuredOutput(json_schema="{nope"))
    with pytest.raises(ValueError, match="choice"):
        structured_from_proto(pb.StructuredOutput(choice=pb.StructuredOutput.Choices()))
    with pytest.raises(ValueError, match="at most"):
        structured_from_proto(pb.StructuredOutput(regex="a" * 70000))


@pytest.mark.parametrize("bias, match", [
    ({1: 100.5}, r"\[-100, 100\]"), ({1: float("nan")}, r"\[-100, 100\]"),
    ({-1: 1.0}, "token ids"), ({"1": 1.0}, "token ids|map token ids"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "at most"),
    (((1, 1.0), (1, 2.0)), "unique"),
])
def test_logit_bias_is_bounded(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


def test_engine_edge_refuses_bias_ids_past_the_vocabulary():
    limits = EngineLimits(vocab_size=100, max_model_len=64)
    check_engine_request(limits, "r", [1, 2], SamplingParams(logit_bias={99: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        check_engine_request(limits, "r", [1, 2], SamplingParams(logit_bias={100: 1.0}))


def _req(params, rid="r"):
    return Request(rid, [1, 2, 3], params, params.max_tokens, seed=1)


def test_logit_bias_forces_and_bans_tokens_in_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(1, 50).repeat(3, 1)  # [N, V]: the same row three times
    top = int(logits[0].argmax())
    sampler = Sampler(50)
    forced = SamplingParams(temperature=0, logit_bias={11: 100.0})
    banned = SamplingParams(temperature=0, logit_bias={top: -100.0})
    hot = SamplingParams(temperature=1.0, seed=3, logit_bias={42: 100.0})
    out = sampler(logits.clone(), [_req(forced, "a"), _req(banned, "b"), _req(hot, "c")])
    assert out.token_ids[0] == 11 and out.token_ids[1] != top and out.token_ids[2] == 42
    plain = sampler(logits.clone(), [_req(SamplingParams(temperature=0))] * 3)
    assert plain.token_ids[1] == top  # the bias, not the row, made the difference
