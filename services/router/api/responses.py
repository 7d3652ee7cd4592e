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
from pdserve.services.router.api.tools import ToolPlan, new_call_id, parse_call, tool_plan


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

    def __init__(self, meta: ResponseMeta, text_of: fmt.TokenText,
                 echo: Optional[list[str]] = None, n: int = 1):
        """`echo`: each prompt's text, put before its choices' completions (choice i
        answers prompt i // n)."""
        self.meta, self.text_of = meta, text_of
        self._echo, self._n = echo, n
        self._templates: dict[int, Optional[tuple[str, str]]] = {}  # choice -> text_event's

    def text_event(self, index: int, text: str) -> Optional[str]:
        """fmt.sse(self.chunk(index, text, None, None)) for a delta of text alone (no
        logprobs, not the last), from a template made once per choice: only the text is
        JSON-encoded per token. None: this format cannot (use chunk())."""
        if index not in self._templates:
            self._templates[index] = self._template(index)
        t = self._templates[index]
        return None if t is None else t[0] + fmt.json_str(text) + t[1]

    def _template(self, index: int) -> Optional[tuple[str, str]]:
        return fmt.sse_template(self.chunk(index, fmt.TEXT_MARK, None, None))

    @classmethod
    def create(cls, meta: ResponseMeta, text_of: fmt.TokenText, body, tokenizer):
        if not body.echo:
            return cls(meta, text_of)
        p = body.prompt
        if isinstance(p, str):
            texts = [p]
        elif p and all(isinstance(x, int) for x in p):
            texts = [tokenizer.decode(p, skip_special_tokens=False)]
        else:
            texts = [x if isinstance(x, str) else tokenizer.decode(x, skip_special_tokens=False)
                     for x in p]
        return cls(meta, text_of, texts, body.n)

    def _echoed(self, index: int) -> str:
        return self._echo[index // self._n] if self._echo else ""

    def opening(self, index: int) -> list[dict]:
        echo = self._echoed(index)
        return [self.chunk(index, echo, None, None)] if echo else []

    def logprobs(self, delta: Delta, offset: int) -> Optional[dict]:
        if not self.meta.logprobs:
            return None
        return fmt.completion_logprobs(delta.logprobs, self.text_of, offset)

    def chunk(self, index: int, text: str, logprobs, finish_reason) -> dict:
        m = self.meta
        return fmt.completion_chunk(m.id, m.created, m.model, index, text, logprobs,
                                    finish_reason, m.include_usage)

    def choice(self, index: int, text: str, logprobs, finish_reason) -> dict:
        return {"index": index, "text": self._echoed(index) + text, "logprobs": logprobs,
                "finish_reason": finish_reason}


class ChatFormat(CompletionFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, meta: ResponseMeta, text_of: fmt.TokenText,
                 tool: Optional[ToolPlan] = None):
        super().__init__(meta, text_of)
        self._tool = tool
        self._calls: dict[int, str] = {}  # choice index -> its call id, once streamed
        self._texts: dict[int, str] = {}  # choice index -> output so far ("required" only)

    @classmethod
    def create(cls, meta: ResponseMeta, text_of: fmt.TokenText, body, tokenizer):
        return cls(meta, text_of, tool_plan(body, tokenizer.chat_template))

    def _template(self, index: int) -> Optional[tuple[str, str]]:
        if self._tool is not None:  # tool calls reshape the deltas
            return None
        return super()._template(index)

    def opening(self, index: int) -> list[dict]:
        m = self.meta
        return [fmt.chat_chunk(m.id, m.created, m.model, index,
                               {"role": "assistant", "content": ""}, None, None,
                               m.include_usage)]

    def logprobs(self, delta: Delta, offset: int) -> Optional[dict]:
        return fmt.chat_logprobs(delta.logprobs, self.text_of) if self.meta.logprobs else None

    def chunk(self, index: int, text: str, logprobs, finish_reason) -> Optional[dict]:
        """None: nothing to send yet (a "required" tool call streams once it is whole)."""
        if self._tool is not None:
            delta, finish_reason = self._tool_delta(index, text, finish_reason)
            if delta is None:
                return None
        else:
            delta = {"content": text} if text or finish_reason is None else {}
        m = self.meta
        return fmt.chat_chunk(m.id, m.created, m.model, index, delta, logprobs, finish_reason,
                              m.include_usage)

    def _tool_delta(self, index: int, text: str, finish_reason):
        """OpenAI's tool-call deltas: the first carries id, type and name, the rest only
        argument text. A named function streams its arguments as they come."""
        if self._tool.name is None:  # the name is inside the output: wait for all of it
            whole = self._texts.get(index, "") + text
            self._texts[index] = whole
            if finish_reason is None:
                return None, None
            call = parse_call(self._tool, whole)
            if call is None:
                return {"content": whole}, finish_reason
            return {"tool_calls": [_call_json(new_call_id(), *call, 0)]}, "tool_calls"
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        if not text:
            return ({} if finish_reason is not None else None), reason
        if index in self._calls:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, reason
        self._calls[index] = new_call_id()
        return {"tool_calls": [_call_json(self._calls[index], self._tool.name, text, 0)]}, reason

    def choice(self, index: int, text: str, logprobs, finish_reason) -> dict:
        message = {"role": "assistant", "content": text}
        call = parse_call(self._tool, text) if self._tool is not None else None
        if call is not None:
            message = {"role": "assistant", "content": None,
                       "tool_calls": [_call_json(new_call_id(), *call)]}
            finish_reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason}


def _call_json(call_id: str, name: str, arguments: str, index: Optional[int] = None) -> dict:
    call = {"id": call_id, "type": "function", "function": {"name": name,
                                                            "arguments": arguments}}
    return call if index is None else {"index": index, **call}


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
        plain = not form.meta.logprobs  # text deltas can take form.text_event
        async for index, delta in iterate_within(run.deltas(), deadline):
            usage.add(delta)
            if delta.finish_reason is None:
                if not delta.text and not delta.token_ids:
                    continue
                if plain:
                    event = form.text_event(index, delta.text)
                    if event is not None:
                        yield event
                        continue
            lps = form.logprobs(delta, offsets[index])
            offsets[index] += len(delta.text)
            chunk = form.chunk(index, delta.text, lps, delta.finish_reason)
            if chunk is None:
                continue
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
