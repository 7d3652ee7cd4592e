"""Bad sampling input is a ValueError naming the field (a 400 at the HTTP edge), never a crash
in the sampler; token ids past the vocabulary are harmless and ignored."""

import math

import pytest
import torch

from pdserve.common.engine.request import Request
from pdserve.common.engine.sampler import Sampler
from pdserve.common.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from pdserve.services.router.api.errors import APIError
from pdserve.services.router.api.openai_jobs import completion_job
from pdserve.services.router.api.openai_protocol import CompletionRequest
from pdserve.tests.unit.test_router_openai_jobs import state

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("field, value", [
    ("temperature", NAN), ("temperature", INF), ("temperature", -INF),
    ("top_p", NAN), ("top_p", INF),
    ("min_p", NAN), ("min_p", INF),
    ("repetition_penalty", NAN), ("repetition_penalty", INF), ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300),
    ("presence_penalty", NAN), ("presence_penalty", INF),
    ("frequency_penalty", NAN), ("frequency_penalty", -INF),
    ("temperature", "1.0"), ("top_p", True),
    ("top_k", 2.5), ("top_k", NAN), ("max_tokens", True), ("max_tokens", 3.0),
    ("min_tokens", 1.5), ("logprobs", True), ("logprobs", 1.0),
    ("seed", 2 ** 63), ("seed", -2 ** 63 - 1), ("seed", 1.5), ("seed", True),
    ("stop_token_ids", (-1,)), ("stop_token_ids", (2 ** 32,)), ("stop_token_ids", (1.5,)),
    ("stop_token_ids", (NAN,)), ("stop_token_ids", (True,)),
    ("stop_token_ids", tuple(range(MAX_STOP_TOKEN_IDS + 1))),
])
def test_bad_value_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(field + " must be"), info.value


def test_good_edge_values_pass():
    p = SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, repetition_penalty=1e-6,
                       seed=-2 ** 63, stop_token_ids=(0, 2 ** 32 - 1), top_k=-1)
    assert p.greedy and p.stop_token_ids == (0, 2 ** 32 - 1)
    assert SamplingParams(seed=2 ** 63 - 1, temperature=2.0).seed == 2 ** 63 - 1


@pytest.mark.parametrize("body, param", [
    (dict(temperature=NAN), "temperature"),
    (dict(top_p=INF), "top_p"),
    (dict(frequency_penalty=NAN), "frequency_penalty"),
    (dict(stop_token_ids=[-5]), "stop_token_ids"),
    (dict(stop_token_ids=[2 ** 40]), "stop_token_ids"),
])
def test_router_answers_400_naming_the_parameter(body, param):
    with pytest.raises(APIError) as info:
        completion_job(CompletionRequest(prompt="x", **body), state(max_n=4), "rid")
    assert (info.value.status, info.value.param) == (400, param)


def _req(params, outputs=()):
    r = Request("r", [1, 2, 3], params, params.max_tokens, eos_token_ids=(4,))
    for t in outputs:
        r.append_token(t)
    return r


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_with_stop_ids_past_the_vocabulary(temperature):
    """The HTTP body {"prompt":"hi","max_tokens":3,"min_tokens":1,"stop_token_ids":[1e9]}
    raised IndexError inside the sampler (and killed the step); the id is ignored now, and
    the in-vocabulary stops are still forbidden."""
    params = SamplingParams(max_tokens=3, min_tokens=1, stop_token_ids=(10 ** 9, 2),
                            temperature=temperature, seed=1)
    logits = torch.zeros(1, 8)
    logits[0, 2] = logits[0, 4] = 50.0  # a stop id and the EOS would win without min_tokens
    out = Sampler(8)(logits, [_req(params)])
    assert out.token_ids[0] not in (2, 4)
    after = Sampler(8)(logits, [_req(params, outputs=[5])])  # min_tokens reached
    assert after.token_ids[0] in (2, 4)


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    p = SamplingParams(temperature=1e-30, seed=3)
    assert p.greedy and Sampler(4)(logits, [_req(p)]).token_ids == [1]
