"""A background thread running an asyncio loop for the connector's store I/O.

Lifecycle: `IOThread()` starts the thread and its loop; `submit(coro)` schedules a coroutine
from any thread and returns a concurrent future; `close()` cancels what is pending, stops the
loop and joins the thread. The engine thread never awaits: it submits and later polls results.

`offload(fn, *args)` (from a coroutine on the loop) runs a CPU-bound call (checking loaded
blocks' MACs) on one worker thread, so the loop can answer other I/O between its GIL-holding
pieces. One worker: calls run in submission order, and never more than one core goes to them.

Both threads run torch serially (serial_torch.py): a parallel op there would give the engine
process a second OpenMP team and slow every forward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Callable, TypeVar

from pdserve.connector.serial_torch import serial_torch_on_this_thread

T = TypeVar("T")


class IOThread:
    def __init__(self, name: str = "kv-connector-io"):
        self.loop = asyncio.new_event_loop()
        self._cpu = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=name + "-cpu", initializer=serial_torch_on_this_thread)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        serial_torch_on_this_thread()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def offload(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the worker thread (await it from a coroutine on this loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def run(self, coro, timeout: float):
        """Run a coroutine on the loop and wait for it (for short metadata calls)."""
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            return

        def _stop():
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.stop()

        self.loop.call_soon_threadsafe(_stop)
        self._thread.join(timeout=5)
