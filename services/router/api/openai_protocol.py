"""Request bodies of the OpenAI-compatible HTTP API (the subset pdserve serves).

Unknown fields are ignored, as OpenAI-compatible servers commonly do, so clients that send
newer parameters still work; the ones listed here are honoured or rejected with a clear error.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
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
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    cache_salt: Optional[str] = None


class CompletionRequest(_Sampling):
    # A string, a list of strings (one completion each), token ids, or a list of those.
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None  # top-N alternatives per token
    echo: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
