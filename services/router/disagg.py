"""Disaggregated routing: per request, prefill on a prefill instance and decode on a decode
instance, with the KV hand-off through the KV store, and every fallback to recomputation.

The decision, per engine request:
1. Compute the prompt's block keys exactly as the engines do (model fingerprint and block
   size from the decode instances' Health; `cache_salt` seeds the chain) and ask the store
   master how many leading blocks it holds.
2. If it holds every full block, or fewer than `min_prefill_tokens` prompt tokens are not
   stored, skip prefill: the decode instance loads the stored blocks and computes the rest
   (a prompt shorter than one block has no blocks at all, so it always goes this way).
3. Otherwise Prefill on a prefill instance (which saves the prompt's blocks before it answers),
   and hand its first token and block keys to a decode instance (HandOffStream).
4. A prefill that fails or times out is retried once on another prefill instance; if that
   fails too (or no prefill instance is up) the whole prompt goes to a decode instance, which
   loads what the store holds and computes the rest. Bad input is the client's error, never
   retried. The client sees the same tokens on every path; only the latency differs.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import grpc

from pdserve.common.kv.block_hash import chain_seed, hash_blocks
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.common.convert import (FINISH_FROM_PROTO, logprob_from_proto,
                                             params_to_proto)
from pdserve.services.router.backends import Backend, BackendPool
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.engine_stream import Delta, EngineStream
from pdserve.services.router.errors import APIError, from_backend
from pdserve.services.router.handoff_stream import HandOffStream
from pdserve.services.router.kv_lookup import StoreIndex

log = logging.getLogger(__name__)
_CLIENT_ERRORS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


class DisaggRouter:
    def __init__(self, cfg: RouterConfig, prefill: BackendPool, decode: BackendPool,
                 index: StoreIndex, metrics: RouterMetrics):
        self.cfg, self.prefill, self.decode = cfg, prefill, decode
        self.index, self.metrics = index, metrics

    async def close(self) -> None:
        await self.prefill.close()
        await self.index.close()

    async def open(self, request_id: str, prompt: list[int], params: SamplingParams,
                   cache_salt: Optional[str]):
        """A stream of Deltas for one engine request (see the module docstring)."""
        t0 = time.monotonic()
        keys, block_size = self._block_keys(prompt, cache_salt)
        stored = await self.index.stored_prefix(keys) if keys else 0
        self.metrics.kv_lookup_hit_tokens.inc(stored * block_size)
        hint = tuple(keys[:stored]) if keys else ()
        skip = self._skip_reason(len(prompt), keys, stored, block_size)
        if skip is None:
            first = await self._prefill(request_id, prompt, params, cache_salt, t0)
            if first is not None:
                delta, block_keys, breakdown = first
                return HandOffStream.start(self.decode, request_id, prompt, params,
                                           cache_salt, delta, block_keys, breakdown)
            self.metrics.prefill_fallbacks.inc()
        else:
            self.metrics.prefill_skipped.labels(skip).inc()
        return await EngineStream.open(self.decode, request_id, prompt, params, cache_salt,
                                       block_keys=hint)

    def _block_keys(self, prompt: list[int], salt: Optional[str]):
        """(the prompt's full-block keys, block size); (None, 0) while the geometry is unknown
        (then nothing is looked up and prefill computes everything)."""
        geometry = self.decode.kv_geometry()
        if geometry is None:
            return None, 0
        fingerprint, block_size = geometry
        return hash_blocks(chain_seed(fingerprint, block_size, salt), prompt, block_size), \
            block_size

    def _skip_reason(self, n_prompt: int, keys, stored: int, block_size: int) -> Optional[str]:
        if keys is None:
            return None
        if stored == len(keys):
            return "stored"  # all full blocks (none, for a prompt under one block)
        if n_prompt - stored * block_size < self.cfg.min_prefill_tokens:
            return "short"
        return None

    async def _prefill(self, request_id, prompt, params, salt, t0: float):
        """(first Delta, block keys, breakdown) from a prefill instance, trying a second one
        after a failure; None when neither could (the caller falls back to decode)."""
        req = pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                params=params_to_proto(params), cache_salt=salt)
        tried: tuple[Backend, ...] = ()
        for attempt in range(2):
            try:
                backend = self.prefill.pick(exclude=tried)
            except APIError:
                return None  # no (other) prefill instance is up
            if attempt:
                self.metrics.prefill_retries.inc()
            tried += (backend,)
            sent = time.monotonic()
            try:
                resp = await backend.prefill.Prefill(req, timeout=self.cfg.prefill_timeout_s)
            except grpc.aio.AioRpcError as err:
                if err.code() in _CLIENT_ERRORS:
                    raise from_backend(err) from None
                self._prefill_failed(backend, err)
                continue
            return _first_delta(resp), tuple(resp.block_keys), {
                "router_queue_s": sent - t0, "prefill_queue_s": resp.timings.queue_s,
                "prefill_compute_s": resp.timings.compute_s}
        return None

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
