"""The per-request total deadline at the router (LimitsConfig.request_timeout_s): admission,
the wait for the first token and the whole stream all count against it. Past it the work is
cancelled (which aborts the request in its engines) and the client gets a 504 /
DEADLINE_EXCEEDED, or an error event when tokens were already streamed."""

from __future__ import annotations

import asyncio
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


async def within(work: Awaitable[T], deadline: Optional[float]) -> T:
    if deadline is None:
        return await work
    try:
        return await asyncio.wait_for(work, max(0.0, deadline - time.monotonic()))
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
                item = await asyncio.wait_for(it.__anext__(),
                                              max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise exceeded() from None
        yield item
