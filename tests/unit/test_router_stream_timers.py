"""The router's per-stream timers: one for the request deadline over a whole stream
(deadline.iterate_within) and one for an instance's idle timeout (engine_stream._IdleWatch),
instead of a timer armed per streamed token; and the SSE text events made from a template
(responses.CompletionFormat.text_event), byte for byte what the dict path makes."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.services.router.api import openai_format as fmt
from pdserve.services.router.api.deadline import iterate_within
from pdserve.services.router.api.errors import APIError
from pdserve.services.router.api.responses import ChatFormat, CompletionFormat, ResponseMeta
from pdserve.services.router.api.tools import ToolPlan
from pdserve.services.router.dispatch.engine_stream import EngineStream


async def numbers(n, gap_s=0.0):
    for i in range(n):
        await asyncio.sleep(gap_s)
        yield i


def test_one_timer_for_a_whole_stream(monkeypatch):
    async def main():
        loop = asyncio.get_running_loop()
        armed = []
        call_at = loop.call_at
        monkeypatch.setattr(loop, "call_at", lambda *a: armed.append(a) or call_at(*a))
        got = [x async for x in iterate_within(numbers(200), time.monotonic() + 30)]
        return got, len(armed)

    got, timers = asyncio.run(main())
    assert got == list(range(200)) and timers == 1


def test_deadline_past_while_the_consumer_works_ends_at_the_next_wait():
    """The consumer's own await (a socket send, say) is not cut; the next wait is a 504
    at once, and the consumer's task is not left cancelled."""
    async def main():
        got, slept = [], []
        with pytest.raises(APIError) as err:
            async for x in iterate_within(numbers(5), time.monotonic() + 0.05):
                got.append(x)
                t = time.monotonic()
                await asyncio.sleep(0.1)  # past the deadline
                slept.append(time.monotonic() - t)
        return got, slept, err.value.status, asyncio.current_task().cancelling()

    got, slept, status, cancelling = asyncio.run(main())
    assert got == [0] and slept[0] >= 0.09 and status == 504 and cancelling == 0


def test_deadline_cuts_a_wait_and_other_cancellations_pass_through():
    async def hang():
        yield 1
        await asyncio.Event().wait()
        yield 2

    async def cut():
        got = []
        with pytest.raises(APIError) as err:
            async for x in iterate_within(hang(), time.monotonic() + 0.05):
                got.append(x)
        return got, err.value.status, asyncio.current_task().cancelling()

    assert asyncio.run(cut()) == ([1], 504, 0)

    async def consume():
        async for _ in iterate_within(hang(), time.monotonic() + 30):
            pass

    async def cancelled_from_outside():
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_from_outside())


class FakeCall:
    """A grpc.aio stream call: read() returns the scripted messages after their delays and
    then hangs; cancel() makes a pending read raise CancelledError, as grpc.aio does."""

    def __init__(self, delays):
        self._delays = list(delays)
        self._cancelled = False
        self._pending = None

    async def read(self):
        if self._cancelled:
            raise asyncio.CancelledError()
        if not self._delays:
            self._pending = asyncio.get_running_loop().create_future()
            await self._pending  # hangs until cancelled
        delay = self._delays.pop(0)
        self._pending = asyncio.ensure_future(asyncio.sleep(delay))
        await self._pending
        last = not self._delays
        return pb.DecodeResponse(token_ids=[7], text="x", finish_reason=(
            pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED))

    def cancel(self):
        self._cancelled = True
        if self._pending is not None:
            self._pending.cancel()

    def done(self):
        return self._cancelled


class FakeBackend:
    address = "fake:1"


def test_silent_instance_is_a_504_and_slow_readers_or_steady_streams_are_not():
    async def drain(call, idle_s, consumer_gap_s=0.0):
        stream = EngineStream(call, FakeBackend(), idle_s)
        got = []
        async for delta in stream:
            got.append(delta.finish_reason)
            await asyncio.sleep(consumer_gap_s)
        return got

    async def main():
        # 12 messages 0.02 s apart: 0.24 s in all, each read well within 0.1 s
        steady = await drain(FakeCall([0.02] * 12), 0.1)
        # the reader takes 0.15 s per message: longer than the idle timeout, not the instance
        slow_reader = await drain(FakeCall([0.0] * 3), 0.1, consumer_gap_s=0.15)
        t = time.monotonic()
        with pytest.raises(APIError) as err:
            await drain(FakeCall([0.0, 0.0] + [5.0]), 0.1)  # silent after two tokens
        return steady, slow_reader, err.value, time.monotonic() - t

    steady, slow_reader, err, took = asyncio.run(main())
    assert len(steady) == 12 and steady[-1] == "length"
    assert slow_reader == [None, None, "length"]
    assert err.status == 504 and "stopped sending" in err.message and took < 1.0


META = [ResponseMeta("cmpl-1", "m", 123, False, usage) for usage in (False, True)]
TEXTS = ["x", "", 'quote " and \\ back', "naïve — ü 😀", "\n\t\u0001"]


@pytest.mark.parametrize("meta", META, ids=["plain", "usage"])
@pytest.mark.parametrize("kind", [CompletionFormat, ChatFormat])
def test_text_events_are_the_dict_paths_bytes(meta, kind):
    form = kind(meta, text_of=None)
    for index in (0, 3):
        for text in TEXTS:
            assert form.text_event(index, text) == fmt.sse(form.chunk(index, text, None, None))
            json.loads(form.text_event(index, text)[len("data: "):])


def test_text_events_fall_back_where_a_template_cannot_serve():
    tool = ChatFormat(META[0], None, ToolPlan(name="f", constraint=None))
    assert tool.text_event(0, "x") is None
    clash = CompletionFormat(ResponseMeta("id", fmt.TEXT_MARK, 1, False, False), None)
    assert clash.text_event(0, "x") is None
