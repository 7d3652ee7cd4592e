"""Continuous-batching scheduler with a per-step token budget, chunked prefill and preemption by
recompute.

Each step:
1. Running requests, oldest first, get their next tokens (1 for a decode, the next chunk for a
   prompt still being computed), within the token budget. When the pool cannot hold a running
   request's new tokens, the newest running request is preempted (its blocks freed, its progress
   dropped; full blocks stay in the prefix cache) until the allocation fits.
2. If nobody was preempted, waiting requests are admitted in order while the budget, the
   sequence limit and the pool allow; each starts after its longest prefix-cache hit. A prompt
   larger than the remaining budget is split across steps (chunked prefill).
A request with a chunk scheduled samples a token only when the chunk reaches its last token.

With a KV connector, a newly admitted request whose next blocks can be loaded from outside gets
blocks for them and waits in WAITING_FOR_KV (using no token budget) until the connector reports
the load finished (it resumes after the loaded tokens) or failed (it resumes after the blocks
that did load, and recomputes the rest). Blocks a connector still reads (a save in flight) or
writes (a cancelled load) are held until it reports them done.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from pdserve.common.engine.kv_connector import KVConnector
from pdserve.common.engine.outputs import TokenLogprob
from pdserve.common.engine.request import Request, RequestStatus
from pdserve.common.engine.sampler import SamplerOutput
from pdserve.common.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.common.kv.kv_cache_manager import KVCacheManager

StopCheck = Callable[[Request, int], None]  # sets finish_reason after a token was appended


class Scheduler:
    """Owns every request's progress between steps: `schedule()` decides a step,
    `update_from_output(out, sampled)` books its result (computed tokens, sampled tokens and
    stop checks, prefix-cache publication, finishing, the connector's finished loads and saves)
    and returns the requests that have output to emit. Nothing else advances a request."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True,
                 connector: Optional[KVConnector] = None,
                 check_stop: Optional[StopCheck] = None):
        self.kv = kv
        self.connector = connector
        self.check_stop = check_stop
        self.kv_waiting: dict[str, Request] = {}  # WAITING_FOR_KV
        self.lookup_pending = False  # the waiting head's store lookup runs (connector I/O)
        self.held: dict[str, Request] = {}  # ended, blocks still in the connector's hands
        # finished, final output withheld until the connector saved its KV (a producer)
        self.awaiting_save: dict[str, Request] = {}
        self._released: list[Request] = []  # saved since the last update: emit them now
        self.num_load_failures = 0
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._in_flight: list[Request] = []  # the last schedule()'s requests, in chunk order

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.held) or bool(self._released)

    def schedule(self) -> SchedulerOutput:
        """Decide the next step. Every call must be followed by `update_from_output` with its
        output (after the forward, or with sampled=None when it scheduled nothing)."""
        self.lookup_pending = False
        self._poll_connector()
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        budget = self._schedule_running(scheduled, preempted, self.token_budget)
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        return self._freeze(scheduled, preempted)

    def _freeze(self, scheduled: list[tuple[Request, int]], preempted: list[str]
                ) -> SchedulerOutput:
        scheduled.sort(key=lambda rn: rn[1] != 1)  # decodes first, stable
        self._in_flight = [r for r, _ in scheduled]
        chunks = tuple(
            ScheduledChunk(r.request_id, tuple(r.all_token_ids[r.num_computed_tokens:
                                                               r.num_computed_tokens + n]),
                           r.num_computed_tokens, tuple(self.kv.block_ids(r.request_id)),
                           r.num_computed_tokens + n == r.num_tokens)
            for r, n in scheduled)
        return SchedulerOutput(chunks, tuple(preempted))

    def sampled_requests(self, out: SchedulerOutput) -> list[Request]:
        """The requests whose rows the sampler draws for `out`, in sampler order."""
        return [r for r, c in zip(self._in_flight, out.chunks) if c.sample]

    def connector_batch(self, out: SchedulerOutput) -> list[tuple[Request, int, list[int]]]:
        """(request, new tokens, block ids) for the connector's worker side (`begin_step`),
        with each request's block hashes covering its blocks that become full."""
        batch = []
        for r, c in zip(self._in_flight, out.chunks):
            self.kv.update_block_hashes(r)
            batch.append((r, c.num_tokens, list(c.block_ids)))
        return batch

    def update_from_output(self, out: SchedulerOutput,
                           sampled: Optional[SamplerOutput]) -> list[Request]:
        """Book step `out`'s result; `sampled` has one row per `sampled_requests(out)` (None
        when nothing was scheduled). Returns the requests with output to emit, in order: the
        sampled ones (a finished producer request only once its KV is saved), then those
        whose saves finished."""
        reqs = self._in_flight
        self._in_flight = []
        for r, c in zip(reqs, out.chunks):
            r.num_computed_tokens += c.num_tokens
        emit: list[Request] = []
        if sampled is not None:
            emit = self._append_sampled([r for r, c in zip(reqs, out.chunks) if c.sample],
                                        sampled)
        for r in reqs:
            self.kv.cache_blocks(r)
        emit = [r for r in emit if not self._finish_sampled(r)]
        self._poll_connector()
        emit.extend(self._released)
        self._released = []
        return emit

    def _append_sampled(self, reqs: list[Request], sampled: SamplerOutput) -> list[Request]:
        lps = sampled.logprobs
        for i, (req, tok) in enumerate(zip(reqs, sampled.token_ids)):
            req.append_token(tok)
            if lps is not None and lps[i] is not None:
                req.logprobs.append(TokenLogprob(tok, lps[i][0], tuple(lps[i][1])))
            if self.check_stop is not None:
                self.check_stop(req, tok)
        return reqs

    def _finish_sampled(self, req: Request) -> bool:
        """Finish req if it stopped; True when its final output must wait for a save."""
        if req.finish_reason is None:
            return False
        self.finish(req.request_id, RequestStatus.FINISHED)
        if req.request_id in self.held and self.connector.finish_waits_for_save():
            self.awaiting_save[req.request_id] = req
            return True
        return False

    def _schedule_running(self, scheduled, preempted, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget
            scheduled.append((req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, scheduled, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.kv.req_blocks.get(req.request_id):  # its KV was loaded from outside
                hits, n_cached = [], req.num_computed_tokens
            else:
                hits, n_cached = self.kv.get_computed_blocks(req)
                ext = self._external_tokens(req, n_cached)
                if ext is None:  # the connector's store lookup is still running
                    self.lookup_pending = True
                    return
                if ext:
                    if not self._start_load(req, hits, n_cached, ext):
                        return
                    continue
            n = req.num_tokens - n_cached
            if n > budget:
                if not self.chunked_prefill:
                    return
                n = budget
            if self.kv.allocate_slots(req, n, hits) is None:
                return
            self._admit(req, n_cached)
            req.transition(RequestStatus.RUNNING)
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

    def _admit(self, req: Request, n_cached: int) -> None:
        """Take req off the waiting queue, starting after its n_cached computed tokens."""
        self.waiting.popleft()
        if req.num_cached_tokens < 0:  # first admission: its prefix lookup counts once
            req.num_cached_tokens = n_cached
            self.kv.record_prefix_lookup(req.num_tokens, n_cached)
        req.num_computed_tokens = n_cached

    def _external_tokens(self, req: Request, n_cached: int) -> Optional[int]:
        if self.connector is None:
            return 0
        bs = self.kv.block_size
        self.kv.update_block_hashes(req)  # also without prefix caching: the keys name the blocks
        limit = (req.num_tokens - 1) // bs * bs - n_cached  # leave a token to compute
        matched = self.connector.get_num_new_matched_tokens(req, n_cached)
        if matched is None:
            return None
        ext = min(matched, limit)
        return max(ext, 0) // bs * bs

    def _start_load(self, req: Request, hits, n_cached: int, ext: int) -> bool:
        if self.kv.allocate_slots(req, ext, hits) is None:
            return False
        self._admit(req, n_cached)
        req.num_external_tokens = ext
        req.transition(RequestStatus.WAITING_FOR_KV)
        self.kv_waiting[req.request_id] = req
        self.connector.update_state_after_alloc(req, self.kv.block_ids(req.request_id),
                                                n_cached, ext)
        return True

    def _poll_connector(self) -> None:
        """Take in finished saves and loads (reclaim held blocks, release finished requests
        whose output waited for their save, resume loaded requests)."""
        if self.connector is None:
            return
        saved, loaded = self.connector.get_finished()
        failed = self.connector.get_failed_loads()
        for rid in saved:
            if rid in self.held:
                self._reclaim(self.held.pop(rid))
                req = self.awaiting_save.pop(rid, None)
                if req is not None:
                    self._released.append(req)
        for rid in list(loaded) + list(failed):
            if rid in self.held:  # cancelled while loading: the blocks are free to go now
                self._reclaim(self.held.pop(rid))
                continue
            req = self.kv_waiting.pop(rid, None)
            if req is None:
                continue
            if rid in failed:
                self.num_load_failures += 1
                req.num_computed_tokens += failed[rid] // self.kv.block_size * self.kv.block_size
            else:
                req.num_computed_tokens += req.num_external_tokens
            req.transition(RequestStatus.WAITING)
            self.waiting.appendleft(req)

    def _preempt(self, req: Request) -> None:
        if self.connector is not None:  # (it may copy the blocks out before they go)
            self.connector.request_preempted(req, self.kv.block_ids(req.request_id))
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.transition(RequestStatus.PREEMPTED)
        req.transition(RequestStatus.WAITING)
        self.waiting.appendleft(req)

    def finish(self, request_id: str, status: RequestStatus) -> Optional[Request]:
        """End a request in any state (FINISHED or CANCELLED), free its blocks, reclaim it."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        loading = self.kv_waiting.pop(request_id, None) is not None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not loading and req in self.waiting:
            self.waiting.remove(req)
        req.transition(status)
        saving = self.connector is not None and self.connector.request_finished(
            req, self.kv.block_ids(request_id))  # (told even while loading: it forgets req)
        if loading or saving:
            self.held[request_id] = req  # the connector still uses its blocks
        else:
            self._reclaim(req)
        return req

    def _reclaim(self, req: Request) -> None:
        self.kv.free(req)
        req.transition(RequestStatus.RECLAIMED)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
