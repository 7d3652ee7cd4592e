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
from dataclasses import dataclass, field
from typing import Optional

from pdserve.common.engine.kv_connector import KVConnector
from pdserve.common.engine.request import Request, RequestStatus
from pdserve.common.kv.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True,
                 connector: Optional[KVConnector] = None):
        self.kv = kv
        self.connector = connector
        self.kv_waiting: dict[str, Request] = {}  # WAITING_FOR_KV
        self.lookup_pending = False  # the waiting head's store lookup runs (connector I/O)
        self.held: dict[str, Request] = {}  # ended, blocks still in the connector's hands
        self.num_load_failures = 0
        self.saved_ids: list[str] = []  # held requests whose saves finished; engine drains
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.held)

    def schedule(self) -> SchedulerOutput:
        self.lookup_pending = False
        self.poll_connector()
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.token_budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    return budget
            out.scheduled.append((req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
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
            out.scheduled.append((req, n))
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

    def poll_connector(self) -> None:
        """Take in finished saves and loads (reclaim held blocks, resume loaded requests)."""
        if self.connector is None:
            return
        saved, loaded = self.connector.get_finished()
        failed = self.connector.get_failed_loads()
        for rid in saved:
            if rid in self.held:
                self._reclaim(self.held.pop(rid))
                self.saved_ids.append(rid)
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
        if loading or (self.connector is not None and self.connector.request_finished(
                req, self.kv.block_ids(request_id))):
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
