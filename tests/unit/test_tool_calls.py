"""Tool calls as the router shapes them: the grammar each tool_choice asks for, and the
OpenAI tool_calls bodies and stream deltas built from the generated text."""

import json

import jsonschema
import pytest

from pdserve.services.router.api.errors import APIError
from pdserve.services.router.api.openai_protocol import ChatCompletionRequest
from pdserve.services.router.api.responses import ChatFormat, new_meta
from pdserve.services.router.api.tools import tool_plan

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "noargs"}}]
MSGS = [{"role": "user", "content": "hi"}]


def _body(**kw):
    return ChatCompletionRequest(messages=MSGS, tools=TOOLS, **kw)


def _form(plan):
    return ChatFormat(new_meta("chatcmpl", "m", False, False), str, plan)


def test_required_is_an_any_of_over_the_tools_and_named_is_the_tools_schema():
    req = tool_plan(_body(tool_choice="required"), None)
    schema = json.loads(req.constraint.spec)
    assert req.name is None and len(schema["anyOf"]) == 2
    jsonschema.validate({"name": "weather", "arguments": {"city": "Oslo"}}, schema)
    jsonschema.validate({"name": "noargs", "arguments": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "weather", "arguments": {}}, schema)
    named = tool_plan(_body(tool_choice={"type": "function", "function": {"name": "weather"}}),
                      None)
    assert named.name == "weather" and json.loads(named.constraint.spec) == PARAMS
    assert tool_plan(_body(tool_choice="none"), None) is None


@pytest.mark.parametrize("template, why", [(None, "does not render tools"),
                                           ("{{ tools }}", "not implemented")])
def test_auto_is_a_400_that_says_why(template, why):
    with pytest.raises(APIError, match=why) as err:
        tool_plan(_body(), template)
    assert err.value.param == "tool_choice" and err.value.status == 400


def test_named_call_streams_its_arguments_as_deltas_and_collects_to_one_call():
    plan = tool_plan(_body(tool_choice={"type": "function", "function": {"name": "weather"}}),
                     None)
    form = _form(plan)
    pieces = ['{"city', '": "Os', 'lo"}']
    chunks = [form.chunk(0, p, None, None) for p in pieces] + [form.chunk(0, "", None, "stop")]
    first = chunks[0]["choices"][0]["delta"]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"]["name"] == "weather"
    rest = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:3]]
    assert all(set(d) == {"index", "function"} for d in rest)
    args = "".join([first["function"]["arguments"]] + [d["function"]["arguments"] for d in rest])
    assert json.loads(args) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    body = _form(plan).choice(0, "".join(pieces), None, "stop")
    assert body["finish_reason"] == "tool_calls" and body["message"]["content"] is None
    assert body["message"]["tool_calls"][0]["function"]["arguments"] == "".join(pieces)


def test_required_call_is_sent_whole_and_a_cut_one_is_text():
    plan = tool_plan(_body(tool_choice="required"), None)
    form = _form(plan)
    text = '{"name": "weather", "arguments": {"city": "Rome"}}'
    assert form.chunk(0, text[:10], None, None) is None  # the name is not known yet
    last = form.chunk(0, text[10:], None, "stop")["choices"][0]
    call = last["delta"]["tool_calls"][0]
    assert last["finish_reason"] == "tool_calls" and call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    cut = _form(plan).choice(0, text[:20], None, "length")
    assert cut["message"]["content"] == text[:20] and cut["finish_reason"] == "length"
