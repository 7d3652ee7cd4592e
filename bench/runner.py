"""Sends a list of requests on an arrival schedule and records what each one measured.

Every request gets a task that sleeps until its send time; fixed concurrency (or a cap) is a
semaphore the task holds while its request is in flight. A chat turn also waits for its
conversation's previous turn, because its history includes the server's real reply; its
latencies count from when it was actually sent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.record import RequestRecord, StreamTrace
from pdserve.bench.request import BenchRequest


@dataclass(frozen=True)
class RunOutput:
    records: tuple[RequestRecord, ...]
    duration_s: float  # first send -> last completion


class _Conversations:
    """Chat histories, and a way to wait until a conversation's turn t may go."""

    def __init__(self):
        self._history: dict[int, list[dict]] = {}
        self._done: dict[tuple[int, int], asyncio.Event] = {}

    def _event(self, conv: int, turn: int) -> asyncio.Event:
        return self._done.setdefault((conv, turn), asyncio.Event())

    async def messages(self, req: BenchRequest) -> Optional[list[dict]]:
        new = [{"role": r, "content": c} for r, c in req.messages or ()]
        if req.conversation is None:
            return new or None
        if req.turn > 0:
            await self._event(req.conversation, req.turn - 1).wait()
        return self._history.get(req.conversation, []) + new

    def finished(self, req: BenchRequest, sent: Optional[list[dict]], reply: str) -> None:
        if req.conversation is None:
            return
        self._history[req.conversation] = (sent or []) + [
            {"role": "assistant", "content": reply}]
        self._event(req.conversation, req.turn).set()


async def run_load(requests: Sequence[BenchRequest], client, arrivals: ArrivalConfig,
                   seed: int = 0, progress: bool = True) -> RunOutput:
    from tqdm import tqdm

    offsets = arrivals.offsets(len(requests), np.random.default_rng([seed, 2]))
    cap = asyncio.Semaphore(arrivals.concurrency) if arrivals.concurrency else None
    convs = _Conversations()
    bar = tqdm(total=len(requests), disable=not progress, unit="req", leave=False)
    start = time.perf_counter()

    async def one(i: int, req: BenchRequest) -> RequestRecord:
        if offsets is not None:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        messages = await convs.messages(req)
        if cap is not None:
            await cap.acquire()
        trace = StreamTrace(sent_t=time.perf_counter())
        try:
            await client.send(req, messages, trace)
        finally:
            if cap is not None:
                cap.release()
            convs.finished(req, messages, trace.text)
            bar.update(1)
        return trace.to_record(i, req.tier, start, req.prompt_len)

    try:
        records = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    finally:
        bar.close()
    end = max((start + r.start_s + (r.e2e_s or 0.0) for r in records), default=start)
    return RunOutput(tuple(records), end - start)
