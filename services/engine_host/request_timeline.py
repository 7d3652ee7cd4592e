"""When a request reached each phase inside this engine, observed from outside the engine.

The engine has no per-request timestamps of its own, so the AsyncEngine's thread looks at a
request between steps: status WAITING_FOR_KV means its KV is loading; RUNNING (or finished)
means it was scheduled; more tokens than it came with means its first token was sampled.
Scheduling happens at the start of a step, so "seen scheduled after step k" is stamped with
step k's start, and "first token sampled in step k" with its end. Precision is one step.

Only requests that have not sampled their first token yet are looked at (`TimelineTracker`
holds those alone), so steady decoding costs nothing per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from pdserve.common.engine.request import RequestStatus

_SCHEDULED = (RequestStatus.RUNNING, RequestStatus.FINISHED, RequestStatus.RECLAIMED)


@dataclass
class RequestTimeline:
    """time.time_ns() stamps (0 = not seen). Written by the engine thread; the event loop
    reads it only after the request's final output reached it (happens-after the writes)."""

    accepted_ns: int = 0  # the engine thread added it
    kv_wait_start_ns: int = 0  # first seen in WAITING_FOR_KV
    kv_wait_end_ns: int = 0  # first seen out of it (loaded, or failed -> recompute)
    kv_tokens: int = 0  # tokens it was loading from the store
    scheduled_ns: int = 0  # the start of the step that first ran it
    first_token_ns: int = 0  # the end of the step that sampled its first token here
    finished_ns: int = 0  # the end of the step that emitted its final output

    def kv_load_ns(self, end_ns: int) -> Optional[int]:
        """Time parked for KV (None when it never was); `end_ns` stands in for an unseen end."""
        if not self.kv_wait_start_ns:
            return None
        return max(0, (self.kv_wait_end_ns or end_ns) - self.kv_wait_start_ns)


class TimelineTracker:
    """Engine thread only. `watch` a request right after add_request; `observe` after every
    step with the step's start and end stamps."""

    def __init__(self, core):
        # A core that exposes no requests (test fakes) gets accept/finish stamps only.
        self._core = core
        self._pending: dict[str, tuple[object, RequestTimeline, int]] = {}

    def watch(self, request_id: str, timeline: RequestTimeline) -> None:
        timeline.accepted_ns = time.time_ns()
        req = self._core.get_request(request_id)
        if req is not None:
            self._pending[request_id] = (req, timeline, len(req.all_token_ids))

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def observe(self, step_start_ns: int, step_end_ns: int) -> None:
        if not self._pending:
            return
        done = []
        for rid, (req, tl, n_start) in self._pending.items():
            status = req.status
            if status is RequestStatus.WAITING_FOR_KV:
                if not tl.kv_wait_start_ns:
                    tl.kv_wait_start_ns = step_start_ns
                    tl.kv_tokens = req.num_external_tokens
            elif tl.kv_wait_start_ns and not tl.kv_wait_end_ns:
                tl.kv_wait_end_ns = step_start_ns
            if not tl.scheduled_ns and status in _SCHEDULED:
                tl.scheduled_ns = step_start_ns
            if len(req.all_token_ids) > n_start:
                tl.first_token_ns = step_end_ns
                done.append(rid)
            elif status is RequestStatus.CANCELLED:
                done.append(rid)
        for rid in done:
            del self._pending[rid]

    def __len__(self) -> int:
        return len(self._pending)
