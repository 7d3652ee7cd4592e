"""Between the client's typed values and the Router API's protobuf messages."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence, Union

import grpc

from pdserve.client.types import (ChatMessage, Chunk, ClientError, Completion, FinishReason,
                                  Sampling, TokenLogprob, Usage)
from pdserve.common.rpc import engine_pb2 as epb
from pdserve.common.rpc import router_pb2 as pb

Message = Union[ChatMessage, Mapping[str, str]]

_FINISH = {epb.FINISH_REASON_STOP: FinishReason.STOP,
           epb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
           epb.FINISH_REASON_ABORT: FinishReason.ABORT}
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs")


def sampling_to_proto(s: Sampling) -> epb.SamplingParams:
    out = epb.SamplingParams(stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                             ignore_eos=s.ignore_eos, min_tokens=s.min_tokens,
                             include_stop_str_in_output=s.include_stop_str_in_output)
    for name in _OPTIONAL:
        value = getattr(s, name)
        if value is not None:
            setattr(out, name, value)
    return out


def _message(m: Message) -> pb.ChatMessage:
    if not isinstance(m, ChatMessage):
        m = ChatMessage(role=m["role"], content=m["content"])
    return pb.ChatMessage(role=m.role, content=m.content)


def request(prompt: Optional[str], token_ids: Optional[Sequence[int]],
            messages: Optional[Iterable[Message]], sampling: Sampling, model: str,
            request_id: str, cache_salt: Optional[str]) -> pb.GenerateRequest:
    """Exactly one of `prompt`, `token_ids`, `messages` (ValueError otherwise)."""
    given = [x is not None for x in (prompt, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("pass exactly one of prompt, token_ids, messages")
    req = pb.GenerateRequest(request_id=request_id, model=model,
                             params=sampling_to_proto(sampling))
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        req.chat.messages.extend(_message(m) for m in messages)
    if cache_salt is not None:
        req.cache_salt = cache_salt
    return req


def chunk(msg: pb.GenerateResponse) -> Chunk:
    usage = None
    if msg.HasField("usage"):
        usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens,
                      msg.usage.cached_tokens)
    logprobs = tuple(TokenLogprob(lp.token_id, lp.logprob,
                                  tuple((t.token_id, t.logprob) for t in lp.top))
                     for lp in msg.logprobs)
    return Chunk(text=msg.text, token_ids=tuple(msg.token_ids), logprobs=logprobs,
                 finish_reason=_FINISH.get(msg.finish_reason), usage=usage,
                 breakdown=dict(msg.breakdown))


class Joiner:
    """Joins chunks into a Completion; `result()` raises if the stream never finished."""

    def __init__(self):
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._last: Optional[Chunk] = None

    def add(self, c: Chunk) -> None:
        self._text.append(c.text)
        self._ids.extend(c.token_ids)
        self._logprobs.extend(c.logprobs)
        self._last = c

    def result(self) -> Completion:
        last = self._last
        if last is None or last.finish_reason is None:
            raise ClientError(grpc.StatusCode.UNKNOWN, "the stream ended before it finished")
        return Completion(text="".join(self._text), token_ids=tuple(self._ids),
                          finish_reason=last.finish_reason,
                          usage=last.usage or Usage(0, len(self._ids)),
                          logprobs=tuple(self._logprobs), breakdown=last.breakdown)


def error(exc: grpc.RpcError) -> ClientError:
    return ClientError(exc.code(), exc.details() or "")
