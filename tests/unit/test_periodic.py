"""services/common/periodic.py: stop() ends the loop even when the callable swallows the
cancellation (as redis-py does when a command's connection dies under it)."""

from __future__ import annotations

import asyncio

from pdserve.services.common.periodic import Periodic


def test_stop_ends_a_loop_whose_callable_swallows_the_cancellation():
    calls, swallowed = [], []

    async def run() -> int:
        inside = asyncio.Event()

        async def swallowing() -> None:
            calls.append(1)
            inside.set()
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:  # what redis-py's connection error path amounts to
                if swallowed:  # only once, so a failing run can still be torn down
                    raise
                swallowed.append(1)

        p = Periodic(swallowing, 0.001, "t")
        await p.start(run_now=False)
        await inside.wait()  # the task now sleeps inside the callable: stop() cancels there
        stopping = asyncio.ensure_future(p.stop())
        done, _ = await asyncio.wait({stopping}, timeout=2.0)  # no cancel: it could hang too
        assert done, "stop() did not return: the loop went on after its cancellation"
        stopped_at = len(calls)
        await asyncio.sleep(0.1)
        assert not p.running and swallowed == [1]
        return len(calls) - stopped_at

    assert asyncio.run(run()) == 0


def test_stop_before_the_first_call_and_twice():
    calls = []

    async def fn() -> None:
        calls.append(1)

    async def run() -> None:
        p = Periodic(fn, 10.0, "t")
        await p.start(run_now=True)
        await p.stop()
        await p.stop()
        assert not p.running

    asyncio.run(run())
    assert calls == [1]
