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
    """`items`, each awaited with what is left of the deadline."""
    it = items.__aiter__()
    while True:
        if deadline is None:
            try:
                item = await it.__anext__()
            except StopAsyncIteration:
                return
        else:
            try:
                item = await await_until(it.__anext__(), deadline)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise exceeded() from None
        yield item
