"""How an engine request reaches the engines, as one Protocol for both modes: `Dispatch`.
`ColocatedDispatch` sends it straight to a unified instance of the decode pool (which
computes the prompt and decodes); dispatch/disagg.py's `DisaggRouter` prefills on a prefill
instance and hands off to a decode instance. The router's state holds one of them.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.services.router.dispatch.decode_open import DecodeTarget, PrimedStream, open_decode
from pdserve.services.router.dispatch.requests import EngineRequest, block_keys, decode_request
from pdserve.services.router.routing.candidate import RouteRequest


class Dispatch(Protocol):
    async def open(self, r: EngineRequest):
        """A stream of Deltas for one engine request (APIError when it cannot start)."""

    async def close(self) -> None:
        """Releases what the dispatch itself opened (not the decode pool: the router's)."""


class ColocatedDispatch:
    def __init__(self, target: DecodeTarget):
        self.target = target

    async def open(self, r: EngineRequest) -> PrimedStream:
        pool = self.target.pool
        keys, block_size = block_keys(pool, r.prompt, r.cache_salt)
        route = RouteRequest(len(r.prompt), block_size, 0, r.affinity)
        return await open_decode(self.target, decode_request(r), route, keys or (),
                                 len(r.prompt))

    async def close(self) -> None:
        return None
