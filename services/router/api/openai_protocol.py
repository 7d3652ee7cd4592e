"""Request bodies of the OpenAI-compatible HTTP API, and what happens to every field.

No field is silently ignored. Each top-level field is one of:
- implemented: a field of the models below (OpenAI's, and vLLM's extras: top_k, min_p,
  repetition_penalty, stop_token_ids, min_tokens, ignore_eos, include_stop_str_in_output,
  cache_salt, add_generation_prompt, structured_outputs and guided_*: structured.py; tools:
  tools.py);
- refused: an OpenAI field pdserve does not implement (UNSUPPORTED): a 400 that names it,
  unless it carries its no-op value (null, or the value that changes nothing, e.g.
  response_format {"type": "text"} or tool_choice "none");
- accepted and ignored: IGNORED, fields that never change the output (bookkeeping for
  OpenAI's own platform);
- anything else: a 400 naming the unknown field.
`check_fields()` applies this before the body is validated.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pdserve.services.router.api.errors import bad_request
from pdserve.services.router.api.structured import StructuredFields
from pdserve.services.router.api.tools import ToolFields

# OpenAI fields that never change what is generated: accepted and ignored.
IGNORED = frozenset({"metadata", "store", "service_tier", "prompt_cache_key",
                     "safety_identifier"})


def _none(v) -> bool:
    return v is None


def _empty(v) -> bool:
    return v is None or v == [] or v == {} or v == ""


# OpenAI fields pdserve does not implement -> the test for their no-op value.
UNSUPPORTED = {
    "suffix": _empty,
    "functions": _empty,
    "function_call": lambda v: v is None or v == "none",
    "audio": _none,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _none,
    "web_search_options": _none,
    "reasoning_effort": _none,
    "verbosity": _none,
}

# Fields of a chat message that pdserve does not implement (tool and audio turns): allowed
# only empty, as clients that send a previous answer back include them as null.
MESSAGE_UNSUPPORTED = ("tool_calls", "function_call", "audio", "tool_call_id", "refusal",
                       "annotations")


def check_fields(data: dict, model: type[BaseModel]) -> dict:
    """`data` without its ignored fields; 400 naming the first refused or unknown field."""
    out = {}
    for key, value in data.items():
        if key in model.model_fields:
            out[key] = value
        elif key in UNSUPPORTED:
            if not UNSUPPORTED[key](value):
                raise bad_request(f"Unsupported parameter: '{key}' is not supported by this "
                                  f"server", param=key, code="unsupported_parameter")
        elif key not in IGNORED:
            raise bad_request(f"Unrecognized request argument supplied: '{key}'", param=key,
                              code="unknown_parameter")
    return out


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; only False is served


class _Sampling(StructuredFields, _Body):
    """Parameters common to completions and chat completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # session affinity (when no affinity header is sent)
    cache_salt: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None  # token id (as text) -> bias in [-100, 100]


class CompletionRequest(_Sampling):
    # A string, a list of strings (one completion each), token ids, or a list of those.
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None  # top-N alternatives per token
    echo: bool = False  # the prompt precedes the completion (not with logprobs)
    best_of: Optional[int] = None  # only n is served (the same choices)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # other part types are refused by name
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None
    annotations: Optional[Any] = None


class ChatCompletionRequest(ToolFields, _Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
