"""Waiting for the stop signals every service process honours (SIGTERM, SIGINT)."""

from __future__ import annotations

import asyncio
import signal


async def wait_for_signal() -> None:
    """Return once SIGTERM or SIGINT arrives (the handlers stay installed: a second one is a no-op)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
