"""The router's cheap per-message timeouts (services/router/api/deadline.py)."""

import asyncio
import sys
import time

import pytest

from pdserve.services.router.api.deadline import await_until, await_within, iterate_within
from pdserve.services.router.api.errors import APIError


def test_work_done_in_time_returns_its_value():
    async def work():
        await asyncio.sleep(0)
        return 7

    assert asyncio.run(await_within(work(), 5.0)) == 7


def test_work_past_its_deadline_is_cancelled_and_times_out():
    cancelled = []

    async def main():
        gate = asyncio.Event()  # never set: the work can only end by cancellation

        async def work():
            try:
                await gate.wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        with pytest.raises(asyncio.TimeoutError):
            await await_until(work(), time.monotonic() + 0.01)
        return asyncio.current_task().cancelling() if sys.version_info >= (3, 11) else 0

    assert asyncio.run(main()) == 0  # the caller's task is not left cancelled
    assert cancelled == [True]


def test_iterate_within_ends_in_a_504_past_the_deadline():
    async def main():
        gate = asyncio.Event()

        async def items():
            yield 1
            await gate.wait()
            yield 2

        got = []
        with pytest.raises(APIError) as err:
            async for x in iterate_within(items(), time.monotonic() + 0.05):
                got.append(x)
        return got, err.value.status

    assert asyncio.run(main()) == ([1], 504)
