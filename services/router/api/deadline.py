"""The per-request total deadline at the router (LimitsConfig.request_timeout_s): admission,
the wait for the first token and the whole stream all count against it. Past it the work is
cancelled (which aborts the request in its engines) and the client gets a 504 /
DEADLINE_EXCEEDED, or an error event when tokens were already streamed."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import AsyncIterator, Awaitable, Optional, TypeVar

from pdserve.services.router.api.errors import APIError

T = TypeVar("T")


def deadline_for(arrival: float, timeout_s: float) -> Optional[float]:
    """time.monotonic() by which the request must end; None: no deadline."""
    return arrival + timeout_s if timeout_s > 0 else None


def exceeded() -> APIError:
    import grpc

    return APIError(504, "the request did not finish within the router's deadline",
                    type_="timeout", code="deadline_exceeded",
                    grpc_code=grpc.StatusCode.DEADLINE_EXCEEDED)


async def await_until(work: Awaitable[T], deadline: float) -> T:
    """`work`, awaited until time.monotonic() reaches `deadline`; asyncio.TimeoutError (and
    `work` cancelled) past it. This runs once per streamed message: asyncio.wait_for (3.10,
    3.11) wraps `work` in a new Task each call, asyncio.timeout_at only arms a timer."""
    if sys.version_info < (3, 11):
        return await asyncio.wait_for(work, max(0.0, deadline - time.monotonic()))
    loop = asyncio.get_running_loop()
    async with asyncio.timeout_at(loop.time() + (deadline - time.monotonic())):
        return await work


async def await_within(work: Awaitable[T], timeout_s: float) -> T:
    """`work`, given `timeout_s` seconds (as `await_until`)."""
    return await await_until(work, time.monotonic() + timeout_s)


async def within(work: Awaitable[T], deadline: Optional[float]) -> T:
    if deadline is None:
        return await work
    try:
        return await await_until(work, deadline)
    except asyncio.TimeoutError:
        raise exceeded() from None


async def iterate_within(items: AsyncIterator[T], deadline: Optional[float]) -> AsyncIterator[T]:
    """`items` until the deadline, then APIError 504. One timer for the whole iteration (a
    timer per item cost ~13 us, once per streamed token): past the deadline it cancels this
    task if it is waiting for the next item, else the next wait ends at once (the consumer's
    own awaits between items, a socket send say, are never interrupted)."""
    if deadline is None:
        async for item in items:
            yield item
        return
    if sys.version_info < (3, 11):  # no Task.uncancel: a timer per item
        async for item in _iterate_each_within(items, deadline):
            yield item
        return
    watch = _Watch(asyncio.current_task())
    loop = asyncio.get_running_loop()
    timer = loop.call_at(loop.time() + (deadline - time.monotonic()), watch.expire)
    it = items.__aiter__()
    try:
        while not watch.expired:
            watch.waiting = True
            try:
                item = await it.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if watch.cancelled and watch.task.uncancel() == 0:  # ours alone
                    raise exceeded() from None
                raise
            finally:
                watch.waiting = False
            yield item
        raise exceeded()
    finally:
        timer.cancel()


class _Watch:
    """What the deadline's one timer needs: the consuming task, and whether it waits for an
    item (only then is it cancelled)."""

    def __init__(self, task: asyncio.Task):
        self.task = task
        self.waiting = False
        self.expired = False
        self.cancelled = False  # this watch cancelled the task (to tell it from others)

    def expire(self) -> None:
        self.expired = True
        if self.waiting:
            self.cancelled = True
            self.task.cancel()


async def _iterate_each_within(items: AsyncIterator[T], deadline: float) -> AsyncIterator[T]:
    it = items.__aiter__()
    while True:
        try:
            item = await await_until(it.__anext__(), deadline)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise exceeded() from None
        yield item
