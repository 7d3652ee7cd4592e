"""One engine instance as the router sees it: its channel, health, last reported load, its
circuit breaker, and the router's own count of what it sent there.

A Lease is one call's share of that count: `Backend.dispatch()` opens it, `first_token()`
says the prompt is computed (its tokens leave the queue estimate), `finish(ok)` closes it
(idempotent) and tells the breaker how the call went (ok=None: neither, e.g. the client
cancelled).

The queue estimate counts the tokens the instance will compute, not the prompt's length: a
routing decision is a `Routed` value (the instance and how much of the prompt it has not
cached), and its `dispatch()` counts at most that. Counting a cache hit's whole prompt made a
conversation's holder look busy with work it would never do, so the next turns of its other
conversations went elsewhere and recomputed their history. The decision's count travels
with the decision, so two decisions for one instance before either dispatch cannot swap
their counts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import grpc

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.services.common.tls import TlsConfig, open_channel
from pdserve.services.registry.record import PREFIX_BYTES
from pdserve.services.router.routing.breaker import CircuitBreaker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InstanceLoad:
    running: int = 0
    waiting: int = 0
    waiting_tokens: int = 0
    kv_usage: float = 0.0


class Backend:
    def __init__(self, address: str, kind: str = "decode",
                 breaker: Optional[CircuitBreaker] = None, tls: TlsConfig = TlsConfig()):
        if kind not in ("decode", "prefill"):
            raise ValueError(f"kind must be decode or prefill, got {kind!r}")
        self.address = address
        self.kind = kind
        self.channel = open_channel(address, tls, server_role=kind)  # a unified engine: decode
        self.decode = pb_grpc.DecodeServiceStub(self.channel)
        self.prefill = pb_grpc.PrefillServiceStub(self.channel)
        self.service = self.decode if kind == "decode" else self.prefill  # Health, GetLoad
        self.up = False  # unknown counts as down until a check passes
        self.failures = 0
        self.max_model_len: Optional[int] = None
        self.load: Optional[pb.LoadResponse] = None
        self.health: Optional[pb.HealthResponse] = None  # the last good answer
        self.reported = InstanceLoad()  # the last GetLoad answer
        self._others_active = 0  # what that answer held beyond our open calls then
        self._others_tokens = 0
        self.cache_summary: frozenset = frozenset()  # block key prefixes it says it holds
        self.breaker = breaker or CircuitBreaker(3, 5.0)
        self.inflight = 0  # calls the router has open there
        self.inflight_tokens = 0  # their prompt tokens not computed yet (cached ones left out)
        self.inflight_prompt_tokens = 0  # the same calls' tokens as the caller gave them

    def record_failure(self, unhealthy_after: int, why: str) -> None:
        self.failures += 1
        if self.up and self.failures >= unhealthy_after:
            self.up = False
            log.warning("instance %s is down: %s", self.address, why)

    def record_success(self, health: pb.HealthResponse, load: pb.LoadResponse) -> None:
        if not self.up:
            log.info("instance %s is up (%s, role %s)", self.address, health.model, health.role)
        self.up, self.failures = True, 0
        self.max_model_len = health.max_model_len or None
        self.load = load
        self.health = health
        self.observe(InstanceLoad(load.num_running, load.num_waiting, load.num_waiting_tokens,
                                  load.kv_usage))

    def observe(self, load: InstanceLoad) -> None:
        """A load report read just now. What it holds beyond the router's own open calls is
        other routers' work, fixed until the next report; the router's own part follows its
        calls exactly from here on. (Taking the report as it stands until the next one made
        a prompt that had its first token since look queued for up to a report interval,
        and moved conversations off their holders.)"""
        self.reported = load
        self._others_active = max(0, load.running + load.waiting - self.inflight)
        # the engine counts a waiting request at its whole prompt (its prefix match comes
        # when it is scheduled), so ours come off at the length the engine counts them
        self._others_tokens = max(0, load.waiting_tokens - self.inflight_prompt_tokens)

    @property
    def active(self) -> int:
        """Requests running or waiting there: ours now, plus others' at the last report."""
        return self.inflight + self._others_active

    @property
    def queue_tokens(self) -> int:
        """Prompt tokens it has to compute before a new request: ours (uncached only), plus
        other routers' at the last report."""
        return self.inflight_tokens + self._others_tokens

    def summary_prefix(self, keys) -> int:
        """Leading `keys` in the cache summary the instance reported."""
        n = 0
        summary = self.cache_summary
        while n < len(keys) and keys[n][:PREFIX_BYTES] in summary:
            n += 1
        return n

    def dispatch(self, tokens: int, uncached: Optional[int] = None) -> "Lease":
        """`tokens`: prompt tokens the caller expects computed (store loads already left
        out); `uncached`: what the routing decision found not cached here (None: unknown),
        a cap on what the queue estimate counts."""
        given = tokens
        if uncached is not None:
            tokens = min(tokens, uncached)
        self.breaker.on_dispatch()
        self.inflight += 1
        self.inflight_tokens += tokens
        self.inflight_prompt_tokens += given
        return Lease(self, tokens, given, time.monotonic())


@dataclass(frozen=True)
class Routed:
    """One routing decision: the instance chosen, and how many of the prompt's tokens it has
    not cached (None when the KV geometry is unknown). `BackendPool.choose()` makes it; the
    call that follows opens its lease with `dispatch()`."""

    backend: Backend
    uncached: Optional[int] = None

    def __post_init__(self):
        if self.uncached is not None and self.uncached < 0:
            raise ValueError(f"uncached must be >= 0, got {self.uncached}")

    def dispatch(self, tokens: int) -> "Lease":
        return self.backend.dispatch(tokens, self.uncached)


class Lease:
    def __init__(self, backend: Backend, tokens: int, given: int, sent: float):
        self.backend = backend
        self.sent = sent
        self._tokens = tokens  # in the instance's queue estimate until the first token
        self._given = given  # the same, as the caller counted them (before the cache cap)
        self._open = True

    def first_token(self) -> None:
        self.backend.inflight_tokens -= self._tokens
        self.backend.inflight_prompt_tokens -= self._given
        self._tokens = self._given = 0

    def finish(self, ok: Optional[bool]) -> bool:
        """Closes the lease; True when this failure opened the instance's breaker."""
        if not self._open:
            return False
        self._open = False
        self.first_token()
        self.backend.inflight -= 1
        if ok is None:
            return False
        if ok:
            self.backend.breaker.on_success()
            return False
        return self.backend.breaker.on_failure()
