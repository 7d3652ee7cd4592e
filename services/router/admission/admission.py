"""Admission control: a bounded, prioritized queue in front of the instances.

Lifecycle of a request: `admit()` either dispatches it at once (a slot is free: fewer than
`max_prefilling` requests are between dispatch and their first token), queues it (highest
priority first, then arrival order) or refuses it with 429 / RESOURCE_EXHAUSTED and a
Retry-After. The returned Ticket holds the slot until `first_token()` or `release()` (both
idempotent; release on every exit), which hands it to the next queued request.

Refusals, each counted by reason:
- slo: the estimated TTFT (prompt tokens already in flight, plus those queued ahead at this
  priority or higher, plus its own, over the measured prefill rate) exceeds its target;
- queue_full / tokens_full: the queue holds `max_queued` requests or `max_queued_tokens`
  prompt tokens and nothing queued has a lower priority (else the lowest, newest first, is
  shed: counted as shed, refused with 429);
- queue_timeout: it waited `queue_timeout_s` without a slot.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Optional

from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.admission.admission_config import AdmissionConfig
from pdserve.services.router.api.errors import too_many
from pdserve.services.router.admission.prefill_rate import PrefillRate


@dataclass(order=True)
class _Waiter:
    sort_key: tuple  # (-priority, seq): the queue's order
    priority: int = field(compare=False)
    tokens: int = field(compare=False)
    future: asyncio.Future = field(compare=False)


class Ticket:
    def __init__(self, ctl: "AdmissionController", tokens: int):
        self._ctl = ctl
        self._tokens = tokens
        self.dispatched_at = time.monotonic()
        self._holding = True

    def first_token(self) -> None:
        if self._holding:
            self._holding = False
            self._ctl.first_token(self._tokens, self.dispatched_at)

    def release(self) -> None:
        if self._holding:
            self._holding = False
            self._ctl._free(self._tokens)


class AdmissionController:
    def __init__(self, cfg: AdmissionConfig, metrics: RouterMetrics):
        self.cfg = cfg
        self._metrics = metrics
        self._rate = PrefillRate(cfg.prefill_tokens_per_s)
        self._seq = itertools.count()
        self._queue: list[_Waiter] = []  # sorted by sort_key
        self.prefilling = 0
        self.prefilling_tokens = 0

    @property
    def queued_tokens(self) -> int:
        return sum(w.tokens for w in self._queue)

    def estimate_ttft(self, priority: int, tokens: int) -> float:
        ahead = self.prefilling_tokens + sum(w.tokens for w in self._queue
                                             if w.priority >= priority)
        return self._rate.seconds_for(ahead + tokens)

    async def admit(self, tokens: int, priority: int = 0,
                    ttft_slo_s: Optional[float] = None) -> Ticket:
        target = ttft_slo_s if ttft_slo_s is not None else self.cfg.default_ttft_slo_s
        if target > 0:
            estimate = self.estimate_ttft(priority, tokens)
            if estimate > target:
                raise self._refuse("slo", f"estimated time to first token {estimate:.2f}s "
                                          f"exceeds the target {target:.2f}s",
                                   estimate - target)
        if self.prefilling < self.cfg.max_prefilling and not self._queue:
            return self._dispatch(tokens)
        return await self._wait(tokens, priority)

    def _dispatch(self, tokens: int) -> Ticket:
        self.prefilling += 1
        self.prefilling_tokens += tokens
        self._metrics.admission_prefilling.set(self.prefilling)
        return Ticket(self, tokens)

    async def _wait(self, tokens: int, priority: int) -> Ticket:
        self._make_room(tokens, priority)
        waiter = _Waiter((-priority, next(self._seq)), priority, tokens,
                         asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._queue.sort()
        self._metrics.admission_queued.set(len(self._queue))
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future),
                                          self.cfg.queue_timeout_s)
        except asyncio.TimeoutError:
            self._abandon(waiter)
            raise self._refuse("queue_timeout", "no capacity became free in time",
                               self._rate.seconds_for(self.prefilling_tokens)) from None
        except BaseException:  # shed, or the client went away
            self._abandon(waiter)
            raise

    def _make_room(self, tokens: int, priority: int) -> None:
        """Sheds lower-priority waiters until this request fits; refuses it otherwise."""
        cfg = self.cfg
        while (len(self._queue) >= cfg.max_queued
               or self.queued_tokens + tokens > cfg.max_queued_tokens):
            reason = "queue_full" if len(self._queue) >= cfg.max_queued else "tokens_full"
            victim = self._queue[-1] if self._queue else None  # lowest priority, newest
            if victim is None or victim.priority >= priority:
                raise self._refuse(reason, "the router's queue is full",
                                   self._rate.seconds_for(self.prefilling_tokens
                                                          + self.queued_tokens))
            self._queue.pop()
            victim.future.set_exception(self._refuse(
                "shed", "shed for higher-priority requests",
                self._rate.seconds_for(self.prefilling_tokens)))

    def _abandon(self, waiter: _Waiter) -> None:
        """A waiter that stopped waiting leaves the queue; a slot handed to it goes back."""
        if waiter in self._queue:
            self._queue.remove(waiter)
            self._metrics.admission_queued.set(len(self._queue))
        fut = waiter.future
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled() and fut.exception() is None:
            fut.result().release()

    def first_token(self, tokens: int, dispatched_at: float) -> None:
        self._rate.observe(tokens, dispatched_at)
        self._metrics.prefill_rate.set(self._rate.tokens_per_s)
        self._free(tokens)

    def _free(self, tokens: int) -> None:
        self.prefilling -= 1
        self.prefilling_tokens -= tokens
        while self._queue and self.prefilling < self.cfg.max_prefilling:
            waiter = self._queue.pop(0)
            if not waiter.future.done():
                waiter.future.set_result(self._dispatch(waiter.tokens))
        self._metrics.admission_prefilling.set(self.prefilling)
        self._metrics.admission_queued.set(len(self._queue))

    def _refuse(self, reason: str, message: str, retry_after: float):
        self._metrics.admission_rejected.labels(reason).inc()
        return too_many(f"{message}; retry later", reason, retry_after)
