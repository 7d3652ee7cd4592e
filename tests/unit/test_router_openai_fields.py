"""No silently ignored field: every OpenAI field is implemented, refused with a 400 that names
it, or on the documented accept-and-ignore list; unknown fields are 400s naming them."""

import asyncio
import contextlib
import json

import httpx
import pytest

from pdserve.bench.router_fakes import FakeInstance
from pdserve.services.router.api.openai_jobs import completion_job
from pdserve.services.router.api.openai_protocol import IGNORED, UNSUPPORTED, CompletionRequest
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.server import start_router
from pdserve.services.router.state import RouterState
from pdserve.tests.unit.fake_engine import FakeTokenizer

MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

REFUSED = [  # (endpoint, extra fields, the param the 400 names)
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),  # out of [-100, 100]
    ("completions", {"logit_bias": {"five": -100}}, "logit_bias"),
    ("completions", {"logit_bias": {"9999999": 1}}, "logit_bias"),  # past the vocabulary
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("chat", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("chat", {"guided_json": "{not json"}, "guided_json"),
    ("completions", {"tools": [TOOL]}, "tools"),  # chat only
    ("chat", {"tools": [TOOL]}, "tool_choice"),  # auto: the template renders no tools
    ("chat", {"tool_choice": "required"}, "tool_choice"),  # without tools
    ("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {
        "name": "g"}}}, "tool_choice"),  # not among the tools
    ("chat", {"tools": [TOOL, TOOL], "tool_choice": "required"}, "tools"),  # same name
    ("chat", {"tools": [TOOL], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("chat", {"functions": [TOOL["function"]]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),  # no prompt logprobs
    ("completions", {"best_of": 3}, "best_of"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),  # stream false
    ("chat", {"frobnicate": 1}, "frobnicate"),
    ("completions", {"temprature": 0.5}, "temprature"),
    ("chat", {"messages": [{"role": "user", "content": "x", "mood": "happy"}]},
     "messages.0.mood"),
    ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages.0.content.0"),
]

ACCEPTED = [  # no-op values of refused fields, ignored fields, implemented ones
    ("chat", {"logit_bias": None, "tools": [], "tool_choice": "none",
              "response_format": {"type": "text"}, "modalities": ["text"]}),
    ("chat", {"logit_bias": {"5": 10}, "parallel_tool_calls": False,
              "tools": [TOOL], "tool_choice": "none"}),
    ("chat", {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": True}),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}}),
    ("completions", {"structured_outputs": {"choice": ["a", "b"]}, "echo": True}),
    ("chat", {"metadata": {"team": "a"}, "store": False, "service_tier": "auto",
              "prompt_cache_key": "k", "safety_identifier": "s"}),
    ("chat", {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "yo", "refusal": None,
                            "tool_calls": None, "function_call": None, "audio": None,
                            "annotations": []},
                           {"role": "user", "content": [{"type": "text", "text": "again"}]}]}),
    ("completions", {"best_of": 1, "echo": False, "user": "u-1", "suffix": None}),
    ("completions", {"include_stop_str_in_output": True, "stop": ["x"]}),
]


@contextlib.asynccontextmanager
async def router():
    fake = await FakeInstance.start(tokens=2)
    running = None
    try:
        running = await start_router(RouterConfig(model="fake", backends=(fake.address,),
                                                  port=0, grpc_port=-1),
                                     tokenizer=FakeTokenizer())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.http_port}",
                                     timeout=20) as client:
            yield client
    finally:
        if running is not None:
            await running.stop()
        await fake.stop()


def _post(c, kind, extra):
    if kind == "chat":
        body = {"messages": MSGS, "max_tokens": 2, **extra}
        return c.post("/v1/chat/completions", json=body)
    return c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})


@pytest.fixture(scope="module")
def answers():
    async def main():
        async with router() as c:
            refused = [await _post(c, kind, extra) for kind, extra, _ in REFUSED]
            accepted = [await _post(c, kind, extra) for kind, extra in ACCEPTED]
            streamed = await c.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}})
            return refused, accepted, streamed
    return asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("i", range(len(REFUSED)), ids=[p for _, _, p in REFUSED])
def test_each_refused_field_gets_a_400_naming_it(answers, i):
    r = answers[0][i]
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == REFUSED[i][2], err
    assert err["param"].split(".")[-1] in err["message"] or REFUSED[i][2] in err["message"]


@pytest.mark.parametrize("i", range(len(ACCEPTED)))
def test_no_op_ignored_and_implemented_fields_are_served(answers, i):
    r = answers[1][i]
    assert r.status_code == 200, r.text


def test_stream_options_include_usage_is_implemented(answers):
    events = [ln[6:] for ln in answers[2].text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2


def test_include_stop_str_in_output_reaches_the_engine():
    class Pool:
        max_model_len = 64
        healthy = ()

    state = RouterState(RouterConfig(model="fake"), FakeTokenizer(), Pool(), None)
    job = completion_job(CompletionRequest(prompt="x", stop=["y"],
                                           include_stop_str_in_output=True), state, "r")
    assert job.choices[0].params.include_stop_str_in_output


def test_the_lists_do_not_overlap_the_implemented_fields():
    implemented = set(CompletionRequest.model_fields)
    assert not (implemented & set(UNSUPPORTED)) and not (implemented & IGNORED)
