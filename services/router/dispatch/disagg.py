"""Disaggregated routing: per request, prefill on a prefill instance and decode on a decode
instance, with the KV hand-off through the KV store, and the fallback ladder.

The decision, per engine request (each outcome counted in pdserve_router_disagg_decisions):
1. Compute the prompt's block keys exactly as the engines do (model fingerprint and block
   size from the decode instances' Health; `cache_salt` seeds the chain) and ask the store
   master how many leading blocks it holds.
2. Decode computes the prompt itself (unified role, loading what the store holds) when every
   full block is stored ("stored"; a prompt under one block has none), when fewer than
   `min_prefill_tokens` tokens are uncached ("short"), when the least-queued prefill
   instance has more than `max_prefill_queue_tokens` prompt tokens queued ("prefill_busy"),
   or when no prefill instance is up ("no_prefill"). Otherwise: "prefill".
3. Prefill on the instance the prefill policy picks, telling it which leading blocks the
   store holds (it loads them, computes the rest and saves the new blocks before it
   answers), then hand its first token and block keys to a decode instance the decode
   policy picks (HandOffStream; decode_open retries another decode before its first token).
4. The ladder: a prefill that fails or times out is retried on another prefill instance (up
   to `prefill_retries`, with backoff); then the whole prompt goes to a decode instance.
   Bad input is the client's error, never retried. Each rung is counted
   (pdserve_router_fallback_rungs). The client sees the same tokens on every path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import grpc

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.services.common.convert import FINISH_FROM_PROTO, logprob_from_proto
from pdserve.services.router.routing.backend import Backend, Routed
from pdserve.services.router.routing.backends import BackendPool
from pdserve.services.router.routing.candidate import RouteRequest
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch.decode_open import DecodeTarget, open_decode
from pdserve.services.router.dispatch.engine_stream import Delta
from pdserve.services.router.api.errors import APIError, client_fault, from_backend
from pdserve.services.router.dispatch.handoff_stream import HandOffStream
from pdserve.services.router.routing.kv_lookup import StoreIndex
from pdserve.services.router.dispatch.requests import EngineRequest, block_keys, decode_request
from pdserve.services.router.api.router_tracing import outgoing_metadata, prefill_span

log = logging.getLogger(__name__)


class DisaggRouter:
    def __init__(self, cfg: RouterConfig, prefill: BackendPool, decode: DecodeTarget,
                 index: StoreIndex):
        self.cfg, self.prefill, self.decode = cfg, prefill, decode
        self.index, self.metrics = index, decode.metrics

    async def close(self) -> None:
        await self.prefill.close()
        await self.index.close()

    async def open(self, r: EngineRequest):
        """A stream of Deltas for one engine request (see the module docstring)."""
        t0 = time.monotonic()
        keys, block_size = block_keys(self.decode.pool, r.prompt, r.cache_salt)
        stored = await self.index.stored_prefix(keys) if keys else 0
        self.metrics.kv_lookup_hit_tokens.inc(stored * block_size)
        route = RouteRequest(len(r.prompt), block_size, stored, r.affinity)
        decision = self._decide(len(r.prompt), keys, stored, block_size)
        self.metrics.disagg_decisions.labels(decision).inc()
        if decision == "prefill":
            first = await self._prefill(r, route, keys or (), stored, t0)
            if first is not None:
                delta, handed_keys, breakdown = first
                req = decode_request(r, first_token_id=delta.token_ids[0],
                                     block_keys=handed_keys)
                return HandOffStream.start(
                    lambda: open_decode(self.decode, req, route, keys or (), 0),
                    delta, breakdown)
            self.metrics.prefill_fallbacks.inc()
            self.metrics.fallbacks.labels("prefill_to_unified").inc()
        elif decision in ("stored", "short"):
            self.metrics.prefill_skipped.labels(decision).inc()
        hint = tuple(keys[:stored]) if keys else ()
        uncached = len(r.prompt) - stored * block_size
        return await open_decode(self.decode, decode_request(r, block_keys=hint), route,
                                 keys or (), uncached)

    def _decide(self, n_prompt: int, keys, stored: int, block_size: int) -> str:
        prefill_up = self.prefill.candidates(prompt_len=n_prompt)  # none fits: decode alone
        if not prefill_up:
            return "no_prefill"
        if keys is not None:
            if stored == len(keys):
                return "stored"  # all full blocks (none, for a prompt under one block)
            if n_prompt - stored * block_size < self.cfg.min_prefill_tokens:
                return "short"
        limit = self.cfg.max_prefill_queue_tokens
        if limit and min(c.queue_tokens for c in prefill_up) > limit:
            return "prefill_busy"
        return "prefill"

    async def _prefill(self, r: EngineRequest, route: RouteRequest, keys, stored: int,
                       t0: float):
        """(first Delta, block keys, breakdown) from a prefill instance, trying others after
        failures; None when none could (the caller falls back to decode). The `stored`
        leading keys go along: prefill loads them without asking the store again."""
        req = pb.PrefillRequest(request_id=r.request_id, prompt_token_ids=r.prompt,
                                params=r.params_proto, cache_salt=r.cache_salt,
                                block_keys=keys[:stored])
        tried: tuple[Backend, ...] = ()
        fb = self.cfg.fallback
        for attempt in range(fb.prefill_retries + 1):
            if attempt:
                self.metrics.prefill_retries.inc()
                self.metrics.fallbacks.labels("prefill_retry").inc()
                await asyncio.sleep(fb.backoff_s * 2 ** (attempt - 1))
            try:
                routed = self.prefill.choose(route, keys, exclude=tried)
            except APIError:
                return None  # no (other) prefill instance is up
            tried += (routed.backend,)
            sent = time.monotonic()
            resp = await self._prefill_on(routed, req, len(r.prompt) - stored * route.block_size)
            if resp is not None:
                return _first_delta(resp), tuple(resp.block_keys), {
                    "router_queue_s": sent - t0, "prefill_queue_s": resp.timings.queue_s,
                    "prefill_compute_s": resp.timings.compute_s}
        return None

    async def _prefill_on(self, routed: Routed, req, tokens: int):
        """The instance's answer; None when it failed (counted, breaker told). `tokens`: the
        prompt tokens it computes (the stored ones it loads left out)."""
        backend = routed.backend
        lease = routed.dispatch(tokens)
        ok: Optional[bool] = None
        try:
            with prefill_span(backend.address, req.request_id):
                resp = await backend.prefill.Prefill(req, timeout=self.cfg.prefill_timeout_s,
                                                     metadata=outgoing_metadata())
            ok = True
            return resp
        except grpc.aio.AioRpcError as err:
            if client_fault(err):
                ok = True  # the instance is fine; the request is bad
                raise from_backend(err) from None
            ok = False
            self._prefill_failed(backend, err)
            return None
        finally:
            self.prefill.finish(lease, ok)

    def _prefill_failed(self, backend: Backend, err: grpc.aio.AioRpcError) -> None:
        code = err.code()
        self.metrics.prefill_failures.labels(code.name).inc()
        log.warning("prefill on %s failed: %s %s", backend.address, code.name, err.details())
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self.prefill.report_failure(backend, code.name)


def _first_delta(resp: pb.PrefillResponse) -> Delta:
    reason = FINISH_FROM_PROTO.get(resp.finish_reason)
    logprobs = (logprob_from_proto(resp.logprob),) if resp.HasField("logprob") else ()
    return Delta(text=resp.text, token_ids=(resp.first_token_id,), logprobs=logprobs,
                 finish_reason=reason.value if reason is not None else None,
                 num_prompt_tokens=resp.num_prompt_tokens,
                 num_cached_tokens=resp.num_cached_tokens, num_output_tokens=1)
