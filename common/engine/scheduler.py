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

Pipeline parallel (`pipeline_depth` P > 1): up to P scheduled steps may be in flight at once
(vLLM's batch queue). A request in a step in flight is not scheduled again until that step's
output is booked, and is never a preemption victim (its blocks are in use down the pipeline);
each step takes at most ceil(requests / P) sequences and ceil(token budget / P) tokens, so the
requests split into P micro-batches that keep every stage busy: in decode by sequences, in
prefill by tokens (with the whole budget, the first step of a burst of prompts would take every
prompt token and leave the next step empty, so each stage idles while the other computes a
whole budget's worth; with 1/P of it the stages take turns on half-budget chunks). Without
chunked prefill a prompt larger than the share still goes whole, as the step's only prompt.
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
FINISHED_STATES = frozenset({RequestStatus.FINISHED, RequestStatus.CANCELLED,
                             RequestStatus.RECLAIMED})


class Scheduler:
    """Owns every request's progress between steps: `schedule()` decides a step,
    `update_from_output(out, sampled)` books its result (computed tokens, sampled tokens and
    stop checks, prefix-cache publication, finishing, the connector's finished loads and saves)
    and returns the requests that have output to emit. Nothing else advances a request."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True,
                 connector: Optional[KVConnector] = None,
                 check_stop: Optional[StopCheck] = None, pipeline_depth: int = 1):
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
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
        self.pipeline_depth = pipeline_depth
        # the steps scheduled and not yet booked, oldest first: (output, its requests in chunk
        # order); at most pipeline_depth non-empty ones
        self._in_flight: deque[tuple[SchedulerOutput, list[Request]]] = deque()
        self._busy: set[str] = set()  # ids of the requests in those steps

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.held) or bool(self._released)

    def schedule(self) -> SchedulerOutput:
        """Decide the next step. Every output must be booked with `update_from_output` (after
        the forward, or with sampled=None when it scheduled nothing); with pipeline_depth P up
        to P non-empty ones may be scheduled before the oldest is booked."""
        self.lookup_pending = False
        self._poll_connector()
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        cap = self._seq_cap()
        budget = self._schedule_running(scheduled, preempted, self.step_token_budget(), cap)
        if not preempted:
            self._schedule_waiting(scheduled, budget, cap)
        return self._freeze(scheduled, preempted)

    def step_token_budget(self) -> int:
        """Tokens one step may take: the budget (P = 1), else a 1/P share of it, so that a burst
        of prompts splits into P micro-batches instead of one full step and an empty one.
        `token_budget` is the one setting (max_num_batched_tokens, or the ITL controller's
        value); the share is derived from it each step."""
        return max(1, -(-self.token_budget // self.pipeline_depth))

    def _seq_cap(self) -> int:
        """Sequences one step may take: all (P = 1), else a 1/P share of the requests, so
        that P micro-batches fill the pipeline."""
        if self.pipeline_depth == 1:
            return self.max_num_seqs
        n = len(self.running) + len(self.waiting)
        return max(1, -(-n // self.pipeline_depth))

    def _entry(self, out: SchedulerOutput) -> int:
        """Index of `out` in the steps in flight (by identity: two empty steps are equal)."""
        for i, entry in enumerate(self._in_flight):
            if entry[0] is out:
                return i
        raise RuntimeError("this scheduler output is not in flight (booked already?)")

    def _freeze(self, scheduled: list[tuple[Request, int]], preempted: list[str]
                ) -> SchedulerOutput:
        scheduled.sort(key=lambda rn: rn[1] != 1)  # decodes first, stable
        chunks = tuple(
            ScheduledChunk(r.request_id, tuple(r.all_token_ids[r.num_computed_tokens:
                                                               r.num_computed_tokens + n]),
                           r.num_computed_tokens, tuple(self.kv.block_ids(r.request_id)),
                           r.num_computed_tokens + n == r.num_tokens)
            for r, n in scheduled)
        out = SchedulerOutput(chunks, tuple(preempted))
        self._in_flight.append((out, [r for r, _ in scheduled]))
        self._busy.update(r.request_id for r, _ in scheduled)
        return out

    def sampled_requests(self, out: SchedulerOutput) -> list[Request]:
        """The requests whose rows the sampler draws for `out`, in sampler order."""
        return [r for r, c in zip(self._in_flight[self._entry(out)][1], out.chunks) if c.sample]

    def connector_batch(self, out: SchedulerOutput) -> list[tuple[Request, int, list[int]]]:
        """(request, new tokens, block ids) for the connector's worker side (`begin_step`),
        with each request's block hashes covering its blocks that become full."""
        batch = []
        for r, c in zip(self._in_flight[self._entry(out)][1], out.chunks):
            self.kv.update_block_hashes(r)
            batch.append((r, c.num_tokens, list(c.block_ids)))
        return batch

    def update_from_output(self, out: SchedulerOutput,
                           sampled: Optional[SamplerOutput]) -> list[Request]:
        """Book step `out`'s result; `sampled` has one row per `sampled_requests(out)` (None
        when nothing was scheduled). Returns the requests with output to emit, in order: the
        sampled ones (a finished producer request only once its KV is saved), then those
        whose saves finished. Requests that ended while the step was in flight (aborted) are
        skipped."""
        i = self._entry(out)
        reqs = self._in_flight[i][1]
        del self._in_flight[i]
        self._busy.difference_update(r.request_id for r in reqs)
        live = [r.status not in FINISHED_STATES for r in reqs]
        for r, c, ok in zip(reqs, out.chunks, live):
            if ok:
                r.num_computed_tokens += c.num_tokens
        emit: list[Request] = []
        if sampled is not None:
            emit = self._append_sampled([r for r, c in zip(reqs, out.chunks) if c.sample],
                                        sampled)
        for r, ok in zip(reqs, live):
            if ok:
                self.kv.cache_blocks(r)
        emit = [r for r in emit if not self._finish_sampled(r)]
        self._poll_connector()
        emit.extend(self._released)
        self._released = []
        return emit

    def _append_sampled(self, reqs: list[Request], sampled: SamplerOutput) -> list[Request]:
        lps = sampled.logprobs
        emit = []
        for i, (req, tok) in enumerate(zip(reqs, sampled.token_ids)):
            if req.status in FINISHED_STATES:
                continue  # aborted while its step was in flight
            emit.append(req)
            req.append_token(tok)
            if lps is not None and lps[i] is not None:
                req.logprobs.append(TokenLogprob(tok, lps[i][0], tuple(lps[i][1])))
            if self.check_stop is not None:
                self.check_stop(req, tok)
        return emit

    def _finish_sampled(self, req: Request) -> bool:
        """Finish req if it stopped; True when its final output must wait for a save."""
        if req.finish_reason is None:
            return False
        self.finish(req.request_id, RequestStatus.FINISHED)
        if req.request_id in self.held and self.connector.finish_waits_for_save():
            self.awaiting_save[req.request_id] = req
            return True
        return False

    def _schedule_running(self, scheduled, preempted, budget: int, cap: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < cap:
            req = self.running[i]
            if req.request_id in self._busy:  # its step is still in the pipeline
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self._victim()  # never one scheduled this step: req is later
                if victim is None:  # only requests in flight could give blocks: wait for
                    return 0  # them (and admit nobody who would take blocks before req)
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget
            scheduled.append((req, n))
            budget -= n
            i += 1
        return budget

    def _victim(self) -> Optional[Request]:
        """The newest running request not in a step in flight."""
        for req in reversed(self.running):
            if req.request_id not in self._busy:
                return req
        return None

    def _schedule_waiting(self, scheduled, budget: int, cap: int) -> None:
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(scheduled) < cap):
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
                if self.chunked_prefill:
                    n = budget
                elif not self._fits_whole(scheduled, n, budget):
                    return
            if self.kv.allocate_slots(req, n, hits) is None:
                return
            self._admit(req, n_cached)
            req.transition(RequestStatus.RUNNING)
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

    def _fits_whole(self, scheduled, n: int, budget: int) -> bool:
        """Without chunked prefill: may an n-token prompt larger than this step's remaining
        share go whole? Yes when no other prompt is in the step and it fits what is left of the
        full budget (the share is for splitting prompts into micro-batches; a prompt that
        cannot be split must not wait for a step with nothing in it)."""
        if any(k > 1 for _, k in scheduled):
            return False
        return n <= budget + self.token_budget - self.step_token_budget()

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
