"""Turns sampled tokens into `RequestOutput`s: incremental detokenization, stop conditions.

Per request it keeps the detokenizer and the text produced so far. Text that could still become
the start of a stop string is held back until it cannot, so a streamed delta never has to be
taken back; a stop string found in the text ends the request and is cut from the output
(unless include_stop_str_in_output).
"""

from __future__ import annotations

from typing import Optional

from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from pdserve.common.engine.request import Request


class _State:
    __slots__ = ("detok", "text", "emitted", "sent_tokens", "sent_logprobs", "hold")

    def __init__(self, detok: IncrementalDetokenizer, hold: int):
        self.detok = detok
        self.text = ""  # all output text so far (cut at a stop string)
        self.emitted = 0  # chars of text already returned
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.hold = hold  # chars to hold back: longest stop string - 1


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.states: dict[str, _State] = {}

    def add(self, req: Request) -> None:
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        st = _State(IncrementalDetokenizer(self.tokenizer), hold)
        if req.num_output_tokens:  # a first token sampled elsewhere (prefill) and already sent
            st.text = st.detok.push(req.output_token_ids)
            st.emitted = len(st.text)
            st.sent_tokens = req.num_output_tokens
        self.states[req.request_id] = st

    def check_stop(self, req: Request, token: int) -> None:
        """After `token` was appended: set finish_reason / stop_reason if the request ends."""
        p, st = req.params, self.states[req.request_id]
        st.text += st.detok.push([token])
        if token in req.eos_token_ids and req.num_output_tokens > p.min_tokens - 1:
            req.finish_reason = FinishReason.STOP
        elif token in p.stop_token_ids:
            req.finish_reason, req.stop_reason = FinishReason.STOP, token
        elif p.stop and self._find_stop(req, st):
            pass
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = FinishReason.LENGTH

    def _find_stop(self, req: Request, st: _State) -> bool:
        if req.num_output_tokens < req.params.min_tokens:
            return False
        start = max(0, st.emitted - st.hold)
        for stop in req.params.stop:
            idx = st.text.find(stop, start)
            if idx >= 0:
                end = idx + len(stop) if req.params.include_stop_str_in_output else idx
                st.text = st.text[:end]
                req.finish_reason, req.stop_reason = FinishReason.STOP, stop
                return True
        return False

    def make_output(self, req: Request, finished: bool) -> RequestOutput:
        st = self.states[req.request_id]
        if finished and not isinstance(req.stop_reason, str):  # a stop string cut the rest
            st.text += st.detok.flush()
        end = len(st.text) if finished else max(st.emitted, len(st.text) - st.hold)
        new_text = st.text[st.emitted:end]
        st.emitted = end
        new_tokens = req.all_token_ids[req.num_prompt_tokens + st.sent_tokens:]
        st.sent_tokens += len(new_tokens)
        logprobs: Optional[list[TokenLogprob]] = None
        if req.logprobs is not None:
            logprobs = req.logprobs[st.sent_logprobs:]
            st.sent_logprobs = len(req.logprobs)
        timeline = None
        if finished:
            del self.states[req.request_id]
            timeline = {s.value: t for s, t in req.status_times.items()}
            if req.first_token_time is not None:
                timeline["first_token"] = req.first_token_time
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_tokens, new_text=new_text,
            finished=finished, finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason, logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens, timeline=timeline)

    def text_of(self, request_id: str) -> str:
        return self.states[request_id].text
