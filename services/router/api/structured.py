"""OpenAI's `response_format` and vLLM's structured-output extras to one StructuredOutput.

Accepted spellings (at most one constraint per request, else a 400 naming both):
- `response_format`: {"type": "text"} (none), {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
  the schema is enforced whether `strict` is true or false (a token mask cannot half-enforce).
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object"}.
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
Sizes are bounded by StructuredOutput (spec text, choice count); a constraint xgrammar cannot
compile is refused by the engine with INVALID_ARGUMENT, which the router answers as a 400.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pdserve.common.structured_output import StructuredKind, StructuredOutput
from pdserve.services.router.api.errors import bad_request


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: Optional[str] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` (StructuredOutputsParams); its backend tuning knobs
    (whitespace_pattern, disable_*) are refused as unknown fields."""
    model_config = ConfigDict(extra="forbid")
    json_: Optional[Union[str, dict[str, Any], bool]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class StructuredFields(BaseModel):
    """The request fields this module reads (mixed into the request bodies)."""
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    guided_json: Optional[Union[str, dict[str, Any], bool]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


def structured_output_of(body) -> Optional[StructuredOutput]:
    """The request's one constraint, or None; 400 naming the field on anything invalid."""
    found = [(param, so) for param, so in _candidates(body) if so is not None]
    if len(found) > 1:
        raise bad_request(f"only one structured-output constraint per request, got "
                          f"{found[0][0]} and {found[1][0]}", param=found[1][0])
    return found[0][1] if found else None


def _candidates(body):
    rf = body.response_format
    if rf is not None:
        yield "response_format", _response_format(rf)
    so = body.structured_outputs
    if so is not None:
        set_ = [k for k in ("json_", "regex", "choice", "grammar", "json_object")
                if getattr(so, k) not in (None, False)]
        if len(set_) != 1:
            raise bad_request("structured_outputs must set exactly one of json, regex, choice, "
                              "grammar, json_object", param="structured_outputs")
        key = set_[0]
        yield f"structured_outputs.{key.rstrip('_')}", _build(
            f"structured_outputs.{key.rstrip('_')}", key, getattr(so, key))
    for key in ("json_", "regex", "choice", "grammar"):
        value = getattr(body, "guided_" + key.rstrip("_"))
        if value is not None:
            param = "guided_" + key.rstrip("_")
            yield param, _build(param, key, value)


def _response_format(rf: ResponseFormat) -> Optional[StructuredOutput]:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema",
                          param="response_format.json_schema")
    return _build("response_format.json_schema.schema", "json_", rf.json_schema.schema_)


def _build(param: str, key: str, value) -> StructuredOutput:
    try:
        if key == "json_object":
            return StructuredOutput(StructuredKind.JSON_OBJECT)
        if key == "json_":
            text = value if isinstance(value, str) else json.dumps(value)
            return StructuredOutput(StructuredKind.JSON_SCHEMA, spec=text)
        if key == "choice":
            return StructuredOutput(StructuredKind.CHOICE, choices=tuple(value))
        kind = StructuredKind.REGEX if key == "regex" else StructuredKind.GRAMMAR
        return StructuredOutput(kind, spec=value)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None
