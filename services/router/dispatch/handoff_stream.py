"""One disaggregated request's client-facing stream: the first token a prefill instance
sampled, then the tokens a decode instance streams after it.

Lifecycle: `HandOffStream.start(open_decode_fn, ...)` starts opening the Decode call in the
background (`open_decode_fn()`: decode_open.open_decode with the first token and block keys,
which retries another decode instance while none of its tokens was streamed) and returns at
once, so the first token reaches the client without waiting for the decode instance.
Iterating yields the first Delta, then the decode stream's Deltas. `cancel()` (idempotent) cancels the opening or the open call, which aborts
the request in the decode engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

from pdserve.services.router.dispatch.engine_stream import Delta


class HandOffStream:
    def __init__(self, first: Delta, opening: Optional[asyncio.Future], breakdown: dict):
        self._first: Optional[Delta] = first
        self._opening = opening
        self._stream = None  # a decode_open.PrimedStream once open
        self._breakdown = breakdown  # the prefill side's figures, added to the last delta

    @classmethod
    def start(cls, open_decode_fn, first: Delta, breakdown: dict) -> "HandOffStream":
        opening = None
        if first.finish_reason is None:
            opening = asyncio.ensure_future(open_decode_fn())
        return cls(first, opening, breakdown)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self._first is not None:
            delta, self._first = self._first, None
            return self._finishing(delta)
        if self._stream is None:
            if self._opening is None:
                raise StopAsyncIteration
            try:
                self._stream = await self._opening
            finally:
                self._opening = None
        return self._finishing(await self._stream.__anext__())

    def _finishing(self, delta: Delta) -> Delta:
        if delta.finish_reason is None:
            return delta
        return dataclasses.replace(delta, breakdown={**self._breakdown,
                                                     **(delta.breakdown or {})})

    def cancel(self) -> None:
        if self._opening is not None:
            if not self._opening.done():
                self._opening.cancel()
            elif not self._opening.cancelled() and self._opening.exception() is None:
                self._opening.result().cancel()  # opened, never read: close the call
            self._opening = None
        if self._stream is not None:
            self._stream.cancel()
