"""Run an async callable every `interval_s` until stopped: the router's health checks, its
DNS and registry watchers, and the engines' registry heartbeat all keep one of these.

Lifecycle: `start()` (optionally runs the callable once first, so the caller begins with a
fresh answer) -> the task sleeps and calls, forever -> `stop()` cancels it and waits for it.
The callable handles its own errors; one that escapes ends the task.

`stop()` also raises a flag the loop checks after every call, because a cancellation that
lands inside the callable can be swallowed: redis-py turns a CancelledError during a command
on a dying connection into a ConnectionError, which the registry heartbeat catches and logs,
and the loop went on beating forever while its engine waited in `stop()` to shut down (seen
when a SIGKILLed `pdserve up` took Redis and the engines down at once).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Optional


class Periodic:
    def __init__(self, fn: Callable[[], Awaitable[object]], interval_s: float, name: str):
        self._fn, self._interval_s, self._name = fn, interval_s, name
        self._task: Optional[asyncio.Task] = None
        self._stopping = False

    async def start(self, run_now: bool = True) -> None:
        self._stopping = False
        if run_now:
            await self._fn()
        self._task = asyncio.create_task(self._loop(), name=self._name)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self._interval_s)
            if not self._stopping:
                await self._fn()

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
