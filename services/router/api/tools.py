"""OpenAI tool calls, generated under a grammar: `tools` plus `tool_choice`.

- `"none"` (or no tools): no tool call; the tools are not used.
- a named function ({"type": "function", "function": {"name": N}}): the output is N's
  arguments, generated under N's `parameters` JSON schema; returned as one tool call.
- `"required"`: the output is {"name": one of the tools, "arguments": its arguments}, each
  alternative under that tool's schema; returned as one tool call. `parallel_tool_calls`
  permits several calls but never requires them, so one call is always a valid answer.
- `"auto"` (OpenAI's default when tools are sent) needs the model to decide, in its own
  format, whether to call a tool; that needs a chat template that renders tools. Without one
  (SmolLM2's, the tiny model's) it is a 400 saying so; with one it is still a 400 (no parser
  for model-specific tool-call formats yet): use "required" or a named function.
A call's id is "call_" + 24 hex digits; `finish_reason` is "tool_calls" when the arguments
completed, "length" (with the raw text as content) when max_tokens cut them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pdserve.common.structured_output import StructuredKind, StructuredOutput
from pdserve.services.router.api.errors import bad_request

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ToolFields(BaseModel):
    """The chat request fields this module reads (mixed into ChatCompletionRequest)."""
    tools: Optional[list[Tool]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output becomes a tool call: `name` set -> the output is that
    function's arguments; None -> the output is {"name", "arguments"}."""
    name: Optional[str]
    constraint: StructuredOutput


def tool_plan(body, chat_template: Optional[str]) -> Optional[ToolPlan]:
    """None when no tool call is wanted; 400 naming the field on anything not served."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    tools = {t.function.name: t.function for t in body.tools}
    for name in tools:
        if not _NAME.fullmatch(name):
            raise bad_request(f"tools: function names must match [A-Za-z0-9_-]{{1,64}}, got "
                              f"{name[:80]!r}", param="tools")
    if len(tools) != len(body.tools):
        raise bad_request("tools: function names must be unique", param="tools")
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        why = ("this model's chat template does not render tools" if not _renders_tools(
            chat_template) else "parsing a model's own tool-call format is not implemented")
        raise bad_request(f"tool_choice 'auto' (the default with tools) is not supported: "
                          f"{why}; use tool_choice 'required' or a named function",
                          param="tool_choice", code="unsupported_parameter")
    if choice == "required":
        alts = [{"type": "object", "properties": {"name": {"const": n},
                                                  "arguments": _schema(f)},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for n, f in tools.items()]
        schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
        return ToolPlan(None, _constraint(schema))
    name = choice.function.name
    if name not in tools:
        raise bad_request(f"tool_choice names function {name[:80]!r}, which is not in tools",
                          param="tool_choice")
    return ToolPlan(name, _constraint(_schema(tools[name])))


def _renders_tools(template: Optional[str]) -> bool:
    return bool(template) and "tools" in template


def _schema(f: FunctionDef) -> dict:
    # OpenAI: omitting parameters defines a function with an empty parameter list
    return f.parameters if f.parameters is not None else {
        "type": "object", "properties": {}, "additionalProperties": False}


def _constraint(schema: dict) -> StructuredOutput:
    try:
        return StructuredOutput(StructuredKind.JSON_SCHEMA, spec=json.dumps(schema))
    except ValueError as exc:
        raise bad_request(f"tools: {exc}", param="tools") from None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(plan: ToolPlan, text: str) -> Optional[tuple[str, str]]:
    """(function name, arguments JSON text) from a finished output; None if it does not
    parse (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.name is not None:
        return plan.name, text
    if not isinstance(value, dict) or "name" not in value or "arguments" not in value:
        return None
    return value["name"], json.dumps(value["arguments"], ensure_ascii=False)
