"""OpenAI bodies to Jobs: validation names the parameter; choices, seeds and limits are right."""

import pytest

from pdserve.common.random_stream import derive_seed
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.common.convert import params_from_proto, params_to_proto
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.api.errors import APIError
from pdserve.services.router.api.openai_jobs import chat_job, completion_job
from pdserve.services.router.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.services.router.state import RouterState
from pdserve.tests.unit.fake_engine import FakeTokenizer


class Pool:
    max_model_len = 64
    healthy = ()


def state(**kw):
    return RouterState(RouterConfig(model="fake", **kw), FakeTokenizer(), Pool(), None)


def comp(**body):
    return completion_job(CompletionRequest(**body), state(max_n=4), "rid")


def test_completion_defaults_and_forms():
    job = comp(prompt="AB")
    (c,) = job.choices
    assert c.prompt_token_ids == (65, 66)
    assert c.params.max_tokens == 16 and c.params.temperature == 1.0  # OpenAI's defaults
    job = comp(prompt=["A", "BC"], n=2, seed=5)
    assert [c.index for c in job.choices] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in job.choices] == [(65,), (65,), (66, 67), (66, 67)]
    assert [c.params.seed for c in job.choices] == [5, derive_seed(5, 1)] * 2
    assert comp(prompt=[7, 8, 9]).choices[0].prompt_token_ids == (7, 8, 9)


@pytest.mark.parametrize("body, status, param", [
    (dict(prompt="x", temperature=-0.5), 400, "temperature"),
    (dict(prompt="x", top_k=-3), 400, "top_k"),
    (dict(prompt="x", presence_penalty=3), 400, "presence_penalty"),
    (dict(prompt="x", n=5), 400, "n"),
    (dict(prompt=["a", "b", "c"], n=2), 400, "n"),
    (dict(prompt="x" * 64), 400, "prompt"),
    (dict(prompt=""), 400, "prompt"),
    (dict(prompt="x", model="other"), 404, "model"),
    (dict(prompt="x", stop=["s"] * 20), 400, "stop"),
    (dict(prompt="x", seed=-1), 400, "seed"),
])
def test_completion_errors(body, status, param):
    with pytest.raises(APIError) as info:
        comp(**body)
    assert (info.value.status, info.value.param) == (status, param)


def test_chat_max_tokens_and_logprobs():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "h"},
                                         {"type": "text", "text": "i"}]}]
    st = state(default_chat_max_tokens=1000)
    job = chat_job(ChatCompletionRequest(messages=msgs), st, "rid")
    (c,) = job.choices
    assert FakeTokenizer().decode(c.prompt_token_ids) == "<user>hi\n<assistant>"
    assert c.params.max_tokens == 64 - len(c.prompt_token_ids)  # what the model has left
    job = chat_job(ChatCompletionRequest(messages=msgs, max_completion_tokens=3, max_tokens=9,
                                         logprobs=True, top_logprobs=2), st, "rid")
    assert job.choices[0].params.max_tokens == 3 and job.choices[0].params.logprobs == 2
    with pytest.raises(APIError) as info:
        chat_job(ChatCompletionRequest(messages=msgs, top_logprobs=2), st, "rid")
    assert info.value.param == "top_logprobs"


def test_sampling_params_survive_the_wire():
    p = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3,
                       repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5,
                       stop=("x", "yz"), stop_token_ids=(2,), ignore_eos=True, logprobs=0,
                       min_tokens=2, cache_salt="tenant")
    assert params_from_proto(params_to_proto(p), "tenant") == p
    assert params_from_proto(params_to_proto(SamplingParams())) == SamplingParams()
