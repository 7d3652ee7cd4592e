"""A JobRun as an OpenAI response: SSE chunks while streaming, or one body at the end.

`CompletionFormat` and `ChatFormat` hold what differs between /v1/completions and
/v1/chat/completions; `stream_events` and `collect` are the same for both.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Optional

from pdserve.services.router.api import openai_format as fmt
from pdserve.services.router.dispatch.engine_stream import Delta
from pdserve.services.router.api.deadline import iterate_within
from pdserve.services.router.api.errors import APIError
from pdserve.services.router.dispatch.job import prompt_tokens
from pdserve.services.router.dispatch.job_run import JobRun


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    model: str
    created: int
    logprobs: bool
    include_usage: bool


BREAKDOWN_KEY = "pdserve_breakdown"  # bench/breakdown.py reads this key


class CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, meta: ResponseMeta, text_of: fmt.TokenText):
        self.meta, self.text_of = meta, text_of

    def opening(self, index: int) -> list[dict]:
        return []

    def logprobs(self, delta: Delta, offset: int) -> Optional[dict]:
        if not self.meta.logprobs:
            return None
        return fmt.completion_logprobs(delta.logprobs, self.text_of, offset)

    def chunk(self, index: int, text: str, logprobs, finish_reason) -> dict:
        m = self.meta
        return fmt.completion_chunk(m.id, m.created, m.model, index, text, logprobs,
                                    finish_reason, m.include_usage)

    def choice(self, index: int, text: str, logprobs, finish_reason) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}


class ChatFormat(CompletionFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening(self, index: int) -> list[dict]:
        m = self.meta
        return [fmt.chat_chunk(m.id, m.created, m.model, index,
                               {"role": "assistant", "content": ""}, None, None,
                               m.include_usage)]

    def logprobs(self, delta: Delta, offset: int) -> Optional[dict]:
        return fmt.chat_logprobs(delta.logprobs, self.text_of) if self.meta.logprobs else None

    def chunk(self, index: int, text: str, logprobs, finish_reason) -> dict:
        m = self.meta
        delta = {"content": text} if text or finish_reason is None else {}
        return fmt.chat_chunk(m.id, m.created, m.model, index, delta, logprobs, finish_reason,
                              m.include_usage)

    def choice(self, index: int, text: str, logprobs, finish_reason) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}


class _Usage:
    def __init__(self, run: JobRun):
        self.prompt = prompt_tokens(run.job)
        self.completion = 0
        self.cached = 0

    def add(self, delta: Delta) -> None:
        self.completion += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.cached += delta.num_cached_tokens

    def body(self) -> dict:
        return fmt.usage(self.prompt, self.completion, self.cached)


async def stream_events(run: JobRun, form: CompletionFormat, deadline: Optional[float] = None):
    """SSE text; the run is closed on any exit, which aborts what is unfinished. `deadline`:
    time.monotonic() past which the stream ends in an error event (see deadline.py)."""
    usage, offsets = _Usage(run), [0] * len(run.job.choices)
    breakdown = None
    try:
        for c in run.job.choices:
            for chunk in form.opening(c.index):
                yield fmt.sse(chunk)
        async for index, delta in iterate_within(run.deltas(), deadline):
            usage.add(delta)
            if not delta.text and not delta.token_ids and delta.finish_reason is None:
                continue
            lps = form.logprobs(delta, offsets[index])
            offsets[index] += len(delta.text)
            chunk = form.chunk(index, delta.text, lps, delta.finish_reason)
            if delta.breakdown:  # the bench reads it from the last chunk
                chunk[BREAKDOWN_KEY] = breakdown = delta.breakdown
            yield fmt.sse(chunk)
        if form.meta.include_usage:
            m = form.meta
            chunk = fmt.usage_chunk(m.id, m.created, m.model, form.chunk_object, usage.body())
            if breakdown:
                chunk[BREAKDOWN_KEY] = breakdown
            yield fmt.sse(chunk)
    except APIError as err:  # headers are sent: the error travels in the stream
        yield fmt.sse(err.to_json())
    finally:
        run.close()
    yield fmt.DONE


async def collect(run: JobRun, form: CompletionFormat, deadline: Optional[float] = None) -> dict:
    n = len(run.job.choices)
    texts, lps, reasons = [""] * n, [None] * n, [None] * n
    usage = _Usage(run)
    try:
        async for index, delta in iterate_within(run.deltas(), deadline):
            usage.add(delta)
            part = form.logprobs(delta, len(texts[index]))
            if part is not None:
                lps[index] = fmt.merge_logprobs(lps[index], part)
            texts[index] += delta.text
            reasons[index] = delta.finish_reason or reasons[index]
    finally:
        run.close()
    m = form.meta
    return {"id": m.id, "object": form.object, "created": m.created, "model": m.model,
            "choices": [form.choice(i, texts[i], lps[i], reasons[i]) for i in range(n)],
            "usage": usage.body()}


def new_meta(prefix: str, model: str, logprobs: bool, include_usage: bool) -> ResponseMeta:
    return ResponseMeta(f"{prefix}-{uuid.uuid4().hex}", model, int(time.time()), logprobs,
                        include_usage)
