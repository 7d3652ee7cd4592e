"""A bounded, never-blocking hand-off of one request's outputs from the engine thread to asyncio.

The engine thread must never wait on a slow reader, and memory must stay bounded in items, so
when `max_pending` outputs are already queued the newest output is merged into the last queued
one instead of being appended: the reader later gets the same tokens and text in fewer pieces.
All methods run on the event loop thread (the engine thread reaches them through
`loop.call_soon_threadsafe`), so no lock is needed.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Callable, Optional

from pdserve.common.engine.outputs import RequestOutput
from pdserve.services.engine_host.request_timeline import RequestTimeline


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One output equivalent to `a` followed by `b` (b is the later one)."""
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = list(a.logprobs or []) + list(b.logprobs or [])
    return RequestOutput(
        request_id=b.request_id,
        new_token_ids=list(a.new_token_ids) + list(b.new_token_ids),
        new_text=a.new_text + b.new_text,
        finished=b.finished,
        finish_reason=b.finish_reason,
        stop_reason=b.stop_reason,
        logprobs=logprobs,
        num_prompt_tokens=b.num_prompt_tokens or a.num_prompt_tokens,
        num_cached_tokens=b.num_cached_tokens or a.num_cached_tokens,
        num_output_tokens=b.num_output_tokens,
        block_hashes=b.block_hashes if b.block_hashes is not None else a.block_hashes,
    )


class RequestStream:
    """Async iterator over one request's RequestOutputs; `close()` aborts it if unfinished."""

    def __init__(self, request_id: str, max_pending: int, on_abort: Callable[[str], None]):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.request_id = request_id
        self._max_pending = max_pending
        self._on_abort = on_abort
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._ready = asyncio.Event()
        self._accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self._error: Optional[BaseException] = None
        self.finished = False  # the engine sent the final output
        self._closed = False
        self.accepted_at: Optional[float] = None  # loop.time() when the engine took it
        self.timeline = RequestTimeline()  # phase stamps the engine thread fills in

    # --- engine side (called on the loop via call_soon_threadsafe) ---
    def accept(self) -> None:
        if not self._accepted.done():
            self.accepted_at = asyncio.get_running_loop().time()
            self._accepted.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if not self._accepted.done():
            self._accepted.set_exception(exc)
        self._error = exc
        self._ready.set()

    def put(self, out: RequestOutput) -> None:
        if self._closed:
            return
        if len(self._items) >= self._max_pending:
            self._items[-1] = merge_outputs(self._items[-1], out)
        else:
            self._items.append(out)
        self._ready.set()

    # --- reader side ---
    async def wait_accepted(self) -> None:
        """Returns once the engine took the request; raises its ValueError if it refused."""
        await self._accepted

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._items:
            if self.finished or self._closed:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()
        out = self._items.popleft()
        if out.finished:
            self.finished = True
        return out

    @property
    def pending(self) -> int:
        return len(self._items)

    def close(self) -> None:
        """Stop reading; an unfinished request is aborted in the engine (idempotent)."""
        if self._closed:
            return
        self._closed = True
        rejected = False
        if not self._accepted.done():
            self._accepted.cancel()
        elif not self._accepted.cancelled():
            rejected = self._accepted.exception() is not None  # also marks it retrieved
        if not self.finished and not rejected:
            # Not yet accepted still means queued to the engine: abort follows the add in order.
            self._on_abort(self.request_id)
        self._items.clear()
