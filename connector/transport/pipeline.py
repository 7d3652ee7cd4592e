"""Pipelined requests on one connection: send request i+1 before request i is answered.

Why: a storage node answers each WRITE with a tiny ack, so one request at a time leaves the
link idle for a round trip per object (and the node's thread idle while the client prepares
the next frame). With the sends and the answers on two tasks, the node receives the next
frame while its ack for the previous one travels back; the answers still come in order (one
server thread per connection serves its frames in order), so answer i is request i's.

`run_pipeline` is transport-agnostic: the caller gives it how to send frame i and how to
receive one answer. The first failure of either side (a broken connection, a malformed
answer, or the caller's `before_send` raising) cancels the other and is raised: the caller
must then treat the connection as mid-frame (unusable) and every request not yet answered as
not done.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Optional

from pdserve.connector.transport.base import Message, RemoteError

BeforeSend = Callable[[int], Awaitable[None]]  # awaited before request i goes out
OnReply = Callable[[int, "Message | RemoteError"], None]  # request i's answer, as it arrives
Reply = tuple[bool, bytes, memoryview]  # (ok, header, payload) of one answer


async def run_pipeline(count: int, send: Callable[[int], Awaitable[None]],
                       receive: Callable[[], Awaitable[Reply]],
                       before_send: Optional[BeforeSend] = None,
                       on_reply: Optional[OnReply] = None) -> list[Message | RemoteError]:
    """Send requests 0..count-1 in order (each after before_send(i)) while receiving their
    answers in order; a refused request's answer is its RemoteError, not raised."""

    async def send_all() -> None:
        for i in range(count):
            if before_send is not None:
                await before_send(i)
            await send(i)

    async def receive_all() -> list[Message | RemoteError]:
        results: list[Message | RemoteError] = []
        for i in range(count):
            ok, header, payload = await receive()
            result = Message(header, payload) if ok else RemoteError(
                header.decode("utf-8", "replace"))
            if on_reply is not None:
                on_reply(i, result)
            results.append(result)
        return results

    loop = asyncio.get_running_loop()
    sender, receiver = loop.create_task(send_all()), loop.create_task(receive_all())
    try:
        done, _ = await asyncio.wait((sender, receiver), return_when=asyncio.FIRST_EXCEPTION)
        for task in (sender, receiver):
            if task in done and task.exception() is not None:
                raise task.exception()
        return receiver.result()
    finally:
        for task in (sender, receiver):
            task.cancel()
        await asyncio.gather(sender, receiver, return_exceptions=True)
