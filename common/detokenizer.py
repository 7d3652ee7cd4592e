"""Streaming detokenization: turn token ids into text as they arrive, without broken characters.

A byte-level token can end in the middle of a UTF-8 character, and sentencepiece-style decoders
drop a leading space when a token is decoded alone. So, as vLLM's detokenizer does, we decode a
short window: `prefix` = tokens[prefix_offset:read_offset] (already emitted, kept for context) and
`window` = tokens[prefix_offset:]; the new text is what `window` adds past `prefix`. While that
ends in U+FFFD (an incomplete character) we hold it back. Each step decodes only the window, not
the whole sequence.
"""

from __future__ import annotations

from typing import Sequence

from pdserve.common.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: tokens kept only as decoding context
        self._read_offset = 0  # tokens before this have been emitted
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._chunks)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        out = []
        for token_id in token_ids:
            self._ids.append(int(token_id))
            out.append(self._step(final=False))
        return self._emit("".join(out))

    def flush(self) -> str:
        """End of stream: release whatever is held back, incomplete characters included."""
        return self._emit(self._step(final=True))

    def _step(self, final: bool) -> str:
        prefix = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._ids))
        if len(window) <= len(prefix) or (window.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(prefix):]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text
