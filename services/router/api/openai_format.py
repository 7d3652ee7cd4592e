"""Response bodies and stream chunks exactly as OpenAI shapes them."""

from __future__ import annotations

import json
from typing import Optional

from pdserve.common.engine.outputs import TokenLogprob

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


TEXT_MARK = "__pdserve_text__"  # stands for a chunk's text while its template is made
_ENCODED_MARK = json.dumps(TEXT_MARK)


def sse_template(chunk_with_mark: dict) -> Optional[tuple[str, str]]:
    """(before, after): sse(chunk) with TEXT_MARK as its text is before + json(TEXT_MARK) +
    after, so a chunk with another text is before + json_str(text) + after, byte for byte
    what sse() makes, with one string encoded per token instead of the whole dict. None if
    the mark is not there exactly once (a model named like it, say)."""
    parts = sse(chunk_with_mark).split(_ENCODED_MARK)
    return (parts[0], parts[1]) if len(parts) == 2 else None


def json_str(text: str) -> str:
    """text as sse() encodes a string inside a chunk."""
    return json.dumps(text, ensure_ascii=False)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     logprobs: Optional[dict], finish_reason: Optional[str],
                     include_usage: bool) -> dict:
    return _chunk(rid, created, model, "text_completion", index, "text", text, logprobs,
                  finish_reason, include_usage)


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               logprobs: Optional[dict], finish_reason: Optional[str],
               include_usage: bool) -> dict:
    return _chunk(rid, created, model, "chat.completion.chunk", index, "delta", delta,
                  logprobs, finish_reason, include_usage)


def _chunk(rid, created, model, obj: str, index: int, key: str, value, logprobs,
           finish_reason, include_usage: bool) -> dict:
    """One stream chunk; `key` is "text" (completions) or "delta" (chat). With
    stream_options.include_usage every chunk but the last carries "usage": null."""
    body = {"id": rid, "object": obj, "created": created, "model": model,
            "choices": [{"index": index, key: value, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(rid: str, created: int, model: str, obj: str, usage_body: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_body}


class TokenText:
    """Token id -> the text OpenAI puts in logprobs (special tokens shown, bytes kept)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def __call__(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)


def completion_logprobs(lps: tuple[TokenLogprob, ...], text_of: TokenText,
                        offset: int) -> dict:
    """The legacy completions shape; `offset` is the text length before these tokens."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tok = text_of(lp.token_id)
        tokens.append(tok)
        token_lps.append(lp.logprob)
        tops.append({text_of(t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(lps: tuple[TokenLogprob, ...], text_of: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        tok = text_of(token_id)
        return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}

    return {"content": [dict(entry(lp.token_id, lp.logprob),
                             top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in lps]}


def merge_logprobs(acc: Optional[dict], part: dict) -> dict:
    """Joins logprob bodies of consecutive deltas (for non-streaming responses)."""
    if acc is None:
        return part
    for key, value in part.items():
        acc[key] = acc[key] + value
    return acc
