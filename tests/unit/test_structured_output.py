"""Structured outputs in the engine (xgrammar token masks) on the tiny model: outputs follow
the schema / regex / choice, on every path (prefill on one engine then decode on another,
a batch with unconstrained rows); bad constraints are ValueErrors before anything runs."""

import json
import re

import jsonschema
import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig
from pdserve.common.engine.llm import LLM
from pdserve.common.engine.outputs import FinishReason
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured_output import StructuredKind as K
from pdserve.common.structured_output import StructuredOutput
from pdserve.services.common.convert import params_to_proto

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "c": {"enum": ["red", "green"]}},
     "required": ["n", "c"], "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "s": {"type": "string", "maxLength": 4}}, "required": ["s"],
        "additionalProperties": False}}, "required": ["inner"], "additionalProperties": False},
    {"enum": ["a", "b", None, True]},
]


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=128), num_threads=1))


def gen(llm, so, prompts=([5, 6, 7],), **kw):
    params = SamplingParams(**{"max_tokens": 48, "structured_output": so, **kw})
    return llm.generate(list(prompts), params)


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, schema, temperature):
    so = StructuredOutput(K.JSON_SCHEMA, json.dumps(schema))
    for out in gen(llm, so, prompts=([5, 6, 7], [9, 40, 41, 42]), temperature=temperature,
                   seed=3):
        assert out.finish_reason == FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_grammar_and_json_object(llm):
    for seed in range(4):
        (r,) = gen(llm, StructuredOutput(K.REGEX, "[0-9]{3}-[a-z]{2}"), temperature=1.0,
                   seed=seed)
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.text), r.text
        (c,) = gen(llm, StructuredOutput(K.CHOICE, choices=("yes", "no way", 'say "hi"')),
                   temperature=1.0, seed=seed)
        assert c.text in ("yes", "no way", 'say "hi"')
    (g,) = gen(llm, StructuredOutput(K.GRAMMAR, 'root ::= "(" [a-c]+ ")"'), max_tokens=8)
    assert re.fullmatch(r"\([a-c]+\)?", g.text), g.text  # may stop at max_tokens inside
    (j,) = gen(llm, StructuredOutput(K.JSON_OBJECT), max_tokens=6)
    assert j.text.startswith('{"') or j.text == "{}", j.text  # an object, not any JSON value


def test_unconstrained_rows_in_the_batch_are_untouched(llm):
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], plain)[0].token_ids
    so = SamplingParams(max_tokens=10, temperature=0.0,
                        structured_output=StructuredOutput(K.REGEX, "[0-9]{3}"))
    both = llm.generate([[9, 8], [5, 6, 7]], [so, plain])
    assert re.fullmatch("[0-9]{3}", both[0].text) and both[1].token_ids == alone


def test_prefill_samples_under_the_mask_and_decode_continues_the_grammar(llm):
    """Token 0 sampled under the grammar on one engine, handed as first_token_id to another
    engine, whose grammar state replays it: the same text as the unified run."""
    schema = json.dumps(SCHEMAS[1])
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=5,
                            structured_output=StructuredOutput(K.JSON_SCHEMA, schema))
    (full,) = llm.generate([[5, 6, 7]], params)
    decode = LLM(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=64), num_threads=1))
    decode.engine.add_request("d", [5, 6, 7], params, first_token_id=full.token_ids[0])
    rest = []
    while decode.engine.has_unfinished_requests():
        for out in decode.engine.step():
            rest += out.new_token_ids
    assert [full.token_ids[0]] + rest == full.token_ids
    jsonschema.validate(json.loads(full.text), SCHEMAS[1])


@pytest.mark.parametrize("kw", [
    dict(kind=K.JSON_SCHEMA, spec="{not json"), dict(kind=K.JSON_SCHEMA, spec="[1]"),
    dict(kind=K.JSON_SCHEMA, spec=""), dict(kind=K.REGEX, spec=""),
    dict(kind=K.CHOICE, choices=()), dict(kind=K.CHOICE, choices=("a", "")),
    dict(kind="regex", spec="a"), dict(kind=K.GRAMMAR, spec="x" * (64 * 1024 + 1)),
])
def test_bad_specs_are_value_errors(kw):
    with pytest.raises(ValueError, match="structured_output"):
        StructuredOutput(**kw)


def test_a_grammar_that_does_not_compile_is_refused_at_arrival(llm):
    bad = SamplingParams(structured_output=StructuredOutput(K.GRAMMAR, "root ::= undefined"))
    with pytest.raises(ValueError, match="does not compile"):
        llm.engine.add_request("bad", [1, 2], bad)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output={"type": "regex"})


def test_carried_on_the_wire():
    msg = params_to_proto(SamplingParams(structured_output=StructuredOutput(K.JSON_OBJECT)))
    assert msg.structured_output.WhichOneof("constraint") == "json_object"
