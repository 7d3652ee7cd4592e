"""Routing policies: each picks one Candidate for a RouteRequest.

- round_robin: the next one in turn.
- least_load: fewest active requests, then fewest queued prompt tokens.
- power_of_two: two at random, the less loaded of them (near least-load, no herding on a
  stale load report).
- kv_aware: the lowest cost.kv_cost (prefix reuse weighed against load) among the instances
  not far busier than the least busy one (`balanced`).
`Affinity` wraps any of them: a request with a session key goes to the instance that key
hashes to (rendezvous hashing, stable as instances come and go) unless that one is busier
than `max_queue_tokens`.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from typing import Optional, Sequence

from pdserve.services.router.routing.candidate import Candidate, RouteRequest
from pdserve.services.router.routing.cost import kv_cost
from pdserve.services.router.routing.routing_config import CostWeights, RoutingConfig


def _load_key(c: Candidate) -> tuple:
    return (c.active, c.queue_tokens, c.kv_usage)


class RoundRobin:
    def __init__(self):
        self._turn = itertools.count()

    def choose(self, cands: Sequence[Candidate], req: RouteRequest) -> Candidate:
        return cands[next(self._turn) % len(cands)]


class LeastLoad:
    def __init__(self):
        self._turn = itertools.count()  # rotates the start so ties spread out

    def choose(self, cands: Sequence[Candidate], req: RouteRequest) -> Candidate:
        start = next(self._turn) % len(cands)
        return min(_rotated(cands, start), key=_load_key)


class PowerOfTwo:
    def __init__(self, seed: Optional[int] = None):
        self._rng = random.Random(seed)

    def choose(self, cands: Sequence[Candidate], req: RouteRequest) -> Candidate:
        if len(cands) == 1:
            return cands[0]
        a, b = self._rng.sample(range(len(cands)), 2)
        return min(cands[a], cands[b], key=_load_key)


class KVAware:
    def __init__(self, weights: CostWeights):
        self.weights = weights
        self._turn = itertools.count()

    def choose(self, cands: Sequence[Candidate], req: RouteRequest) -> Candidate:
        fair = balanced(cands, self.weights)
        start = next(self._turn) % len(fair)
        return min(_rotated(fair, start),
                   key=lambda c: (kv_cost(c, req, self.weights), c.active))


def balanced(cands: Sequence[Candidate], w: CostWeights) -> list[Candidate]:
    """The candidates not far busier than the least busy one (never empty). Without this, a
    prefix every request shares (one system prompt) draws every conversation to the first
    instance that computed it while the others idle: each running request costs only
    `w.running` there, far less than the prefix saves."""
    least = min(c.active for c in cands)
    return [c for c in cands
            if c.active - least <= w.balance_abs or c.active <= w.balance_rel * least]


class Affinity:
    def __init__(self, inner, max_queue_tokens: int):
        self.inner = inner
        self.max_queue_tokens = max_queue_tokens

    def choose(self, cands: Sequence[Candidate], req: RouteRequest) -> Candidate:
        if req.affinity:
            sticky = max(cands, key=lambda c: _rendezvous(req.affinity, c.address))
            if sticky.queue_tokens <= self.max_queue_tokens:
                return sticky
        return self.inner.choose(cands, req)


def _rendezvous(key: str, address: str) -> bytes:
    return hashlib.blake2b(f"{key}\x00{address}".encode(), digest_size=8).digest()


def _rotated(cands: Sequence[Candidate], start: int) -> list[Candidate]:
    return list(cands[start:]) + list(cands[:start])


def make_policy(name: str, cfg: RoutingConfig):
    base = {"round_robin": RoundRobin, "least_load": LeastLoad, "power_of_two": PowerOfTwo,
            "kv_aware": lambda: KVAware(cfg.weights)}[name]()
    return Affinity(base, cfg.affinity_max_queue_tokens) if cfg.session_affinity else base
