"""Structured outputs, tool calls, logit_bias and echo through the official `openai` client
against live stacks (tiny model): colocated (engine and router in this process) and
disaggregated (prefill samples the first token under the grammar, decode continues it after a
KV-store load). Every JSON output parses and validates with `jsonschema`."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import router_pb2, router_pb2_grpc
from pdserve.common.tokenizer import Tokenizer
from pdserve.tests.integration.disagg_helpers import disagg_stack, engine_load
from pdserve.tests.integration.inproc_stack import inproc_stack

_S = {"type": "string", "maxLength": 6}
_OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    {**_OBJ, "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {**_OBJ, "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                            "c": {"enum": ["red", "green"]}}, "required": ["n", "c"]},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
    {**_OBJ, "properties": {"inner": {**_OBJ, "properties": {"s": _S}, "required": ["s"]}},
     "required": ["inner"]},
    {"enum": ["a", "b", None, True]},
    {"type": "number", "minimum": -5, "maximum": 5},
    {**_OBJ, "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        **_OBJ, "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 100}},
        "required": ["id"]}}}, "required": ["items"]},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"const": "fixed"},
    {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
    {"type": "boolean"},
    {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 9},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string",
                                                                  "maxLength": 3}]},
    {**_OBJ, "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}, "b": _S}},
    {**_OBJ, "properties": {"x": {**_OBJ, "properties": {"y": {**_OBJ, "properties": {
        "z": {"enum": [1, 2]}}, "required": ["z"]}}, "required": ["y"]}}, "required": ["x"]},
    {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "boolean"}}},
    {**_OBJ, "properties": {"kind": {"enum": ["cat", "dog"]},
                            "weight": {"type": "number", "minimum": 0, "maximum": 80}},
     "required": ["kind", "weight"]},
    {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "string",
                                                              "maxLength": 2}},
    {**_OBJ, "properties": {"name": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["name"]},
    {"type": "integer", "minimum": 10, "maximum": 12},
    {**_OBJ, "properties": {"tags": {"type": "array", "maxItems": 2, "items": {
        "enum": ["x", "y"]}}, "flag": {"type": "boolean"}}, "required": ["tags", "flag"]},
    {**_OBJ, "properties": {"point": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "integer", "minimum": -9, "maximum": 9}}}, "required": ["point"]},
]
MSGS = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 160
CLOSE = str(Tokenizer.tiny().encode("}")[0])
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS[16]}},
         {"type": "function", "function": {"name": "lookup", "parameters": SCHEMAS[1]}}]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def stack(request, tmp_path_factory):
    if request.param == "colocated":
        with inproc_stack(max_model_len=512) as s:
            yield request.param, s.router_http, s.router_grpc, None, None
    else:
        with disagg_stack(tmp_path_factory.mktemp("structured"), n_decode=1) as s:
            yield request.param, s.http_url, s.grpc_addr, s.prefill[0], s.decode[0]


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[1] + "/v1", api_key="none", max_retries=0, timeout=120)


def _one(client, kind: str, stream: bool, extra: dict, seed: int) -> tuple[str, str]:
    """(text, finish_reason) of one request, through chat or completions, streamed or not."""
    kw = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0.8, seed=seed, stream=stream,
              extra_body=extra)
    if kind == "chat":
        resp = client.chat.completions.create(messages=MSGS, **kw)
        if not stream:
            return resp.choices[0].message.content, resp.choices[0].finish_reason
        parts = [(c.choices[0].delta.content or "", c.choices[0].finish_reason)
                 for c in resp if c.choices]
    else:
        resp = client.completions.create(prompt="JSON:", **kw)
        if not stream:
            return resp.choices[0].text, resp.choices[0].finish_reason
        parts = [(c.choices[0].text, c.choices[0].finish_reason) for c in resp if c.choices]
    return "".join(p for p, _ in parts), parts[-1][1]


def test_json_schemas_validate_on_every_endpoint(stack):
    """Colocated: every schema through chat and completions, streamed and not. Disaggregated:
    each schema through one of the four, in rotation (all four used): the first requests of a
    prompt go prefill -> decode (the grammar state continues after the prefill's token), the
    later ones hit the store (decode loads the prompt's KV and samples token 0 itself)."""
    client = _client(stack)
    combos = [(k, s) for k in ("chat", "completions") for s in (False, True)]
    jobs = [(i, kind, stream) for i in range(len(SCHEMAS))
            for j, (kind, stream) in enumerate(combos)
            if stack[0] == "colocated" or j == i % len(combos)]
    before = engine_load(stack[3], "prefill").num_finished if stack[3] else 0

    def run(job):
        i, kind, stream = job
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i],
                                                      "strict": True}}
        return job, _one(client, kind, stream, {"response_format": fmt}, seed=i)

    with ThreadPoolExecutor(8) as pool:
        for (i, kind, stream), (text, reason) in pool.map(run, jobs):
            assert reason == "stop", (i, kind, stream, text)
            jsonschema.validate(json.loads(text), SCHEMAS[i])
    if stack[3]:  # first tokens from the prefill instance, and prompts loaded from the store
        assert 1 <= engine_load(stack[3], "prefill").num_finished - before <= len(jobs)
        assert engine_load(stack[4]).kv.blocks_loaded > 0


def test_regex_choice_grammar_and_json_object(stack):
    client = _client(stack)
    cases = [({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
              lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
             ({"guided_regex": "(yes|no), [a-z]{1,4}"},
              lambda t: re.fullmatch("(yes|no), [a-z]{1,4}", t)),
             ({"structured_outputs": {"choice": ["up", "down", 'say "hi"']}},
              lambda t: t in ("up", "down", 'say "hi"')),
             ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
             ({"guided_grammar": 'root ::= "(" [a-c]+ ")"'},
              lambda t: re.fullmatch(r"\([a-c]+\)", t)),
             # the tiny model never closes an object by itself: a bias on "}" (applied
             # before the mask) closes it as soon as the grammar allows
             ({"response_format": {"type": "json_object"}, "logit_bias": {CLOSE: 100}},
              lambda t: json.loads(t) == {})]
    for seed in range(2):
        for j, (extra, ok) in enumerate(cases):
            kind, stream = ("chat", "completions")[j % 2], bool(seed)
            text, reason = _one(client, kind, stream, extra, seed)
            assert reason == "stop" and ok(text), (extra, text)


def test_tool_calls_named_and_required_streamed_and_not(stack):
    client = _client(stack)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        resp = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                              tool_choice=choice, max_tokens=MAX_TOKENS,
                                              temperature=0)
        c = resp.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        assert choice == "required" or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])

        chunks = list(client.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice,
            max_tokens=MAX_TOKENS, temperature=0, stream=True))
        deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert deltas[0].id and deltas[0].function.name == call.function.name
        assert all(d.index == 0 and d.id is None for d in deltas[1:])
        # greedy: the streamed arguments are the non-streamed ones
        assert "".join(d.function.arguments for d in deltas) == call.function.arguments


def test_greedy_under_a_constraint_that_admits_it_is_unchanged(stack):
    """The mask removes only forbidden tokens: when the unconstrained greedy answer is one of
    the allowed ones, the constrained greedy answer is the same text."""
    client = _client(stack)
    # (the tiny model mostly emits stray bytes; this prompt's first 3 tokens are ASCII text)
    free = client.completions.create(model="tiny", prompt="The cat", max_tokens=3,
                                     temperature=0)
    text = free.choices[0].text
    assert text and text.isprintable() and text.isascii(), repr(text)
    pattern = f"({re.escape(text)}|zz[0-9]+)"
    ruled = client.completions.create(model="tiny", prompt="The cat", max_tokens=3,
                                      temperature=0, extra_body={"guided_regex": pattern})
    assert ruled.choices[0].text == text


def test_logit_bias_and_echo(stack):
    client = _client(stack)
    tok = 77
    forced = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4,
                                       temperature=0, logit_bias={str(tok): 100})
    bias = pb.SamplingParams(max_tokens=4, temperature=0, logit_bias={tok: 100.0})
    assert _grpc_tokens(stack, bias) == [tok] * 4  # +100 makes greedy pick it every time
    assert forced.choices[0].text == _grpc_tokens(stack, bias, text=True)
    free = _grpc_tokens(stack, pb.SamplingParams(max_tokens=4, temperature=0))
    banned = _grpc_tokens(stack, pb.SamplingParams(max_tokens=4, temperature=0,
                                                   logit_bias={free[0]: -100.0}))
    assert free[0] != tok and banned[0] != free[0]
    echoed = client.completions.create(model="tiny", prompt="Hello there", max_tokens=3,
                                       temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="Hello there", max_tokens=3,
                                      temperature=0)
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt="x", echo=True, logprobs=1)


def test_grpc_api_carries_the_constraint_and_bad_ones_are_400(stack):
    so = pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=["alpha", "beta"]))
    ids = _grpc_tokens(stack, pb.SamplingParams(max_tokens=20, temperature=1.0, seed=5,
                                                structured_output=so), text=True)
    assert ids in ("alpha", "beta")
    client = _client(stack)
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        client.completions.create(model="tiny", prompt="x", extra_body={"guided_regex": "(("})


def _grpc_tokens(stack, params: pb.SamplingParams, text: bool = False):
    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]), params=params)
    with grpc.insecure_channel(stack[2]) as ch:
        msgs = list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=60))
    if text:
        return "".join(m.text for m in msgs)
    return [t for m in msgs for t in m.token_ids]
