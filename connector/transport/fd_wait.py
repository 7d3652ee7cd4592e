"""Waiting on the event loop for a non-blocking socket to become readable or writable, for
the transport calls asyncio has no `sock_*` method for (splice, SO_RCVLOWAT receives)."""

from __future__ import annotations

import asyncio


async def fd_ready(loop: asyncio.AbstractEventLoop, fd: int, *, write: bool) -> None:
    fut = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader,
                                                                        loop.remove_reader)
    add(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        remove(fd)
