"""A request's phases on one instance (queue, KV load, compute, KV save), from its timeline.

Pure arithmetic on RequestTimeline stamps, shared by the breakdown the services return, the
child spans they record and the queue-time histogram, so all three agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdserve.services.engine_host.request_timeline import RequestTimeline

_NS = 1e-9


@dataclass(frozen=True)
class Interval:
    start_ns: int
    end_ns: int

    @property
    def seconds(self) -> float:
        return max(0, self.end_ns - self.start_ns) * _NS


@dataclass(frozen=True)
class Phases:
    queue: Interval  # arrival -> scheduled (a KV load inside it is subtracted in queue_s)
    compute: Interval  # scheduled -> first token (prefill) or -> final output (decode)
    kv_load: Optional[Interval] = None  # parked in WAITING_FOR_KV
    kv_save: Optional[Interval] = None  # first token -> final output: saves not yet done

    @property
    def queue_s(self) -> float:
        load = self.kv_load.seconds if self.kv_load is not None else 0.0
        return max(0.0, self.queue.seconds - load)


def request_phases(tl: RequestTimeline, arrival_ns: int, end_ns: int,
                   first_token_ends_compute: bool) -> Optional[Phases]:
    """None when the engine thread never saw the request scheduled (an engine without a
    scheduler table, or a request that ended before it ran): nothing to split then.

    `first_token_ends_compute`: prefill, whose compute ends with its first token and whose
    wait after it is for KV saves; decode computes until its final output."""
    if not tl.scheduled_ns:
        return None
    # Stamps come from two threads' reads of the clock: keep them in order, so no phase is
    # negative and the phases tile [arrival, end].
    sched = max(tl.scheduled_ns, arrival_ns)
    kv_load = None
    if tl.kv_wait_start_ns:
        start = min(max(tl.kv_wait_start_ns, arrival_ns), sched)
        kv_load = Interval(start, min(max(tl.kv_wait_end_ns or sched, start), sched))
    if first_token_ends_compute:
        done = max(tl.first_token_ns or end_ns, sched)
        end = max(end_ns, done)
        return Phases(Interval(arrival_ns, sched), Interval(sched, done), kv_load,
                      Interval(done, end))
    return Phases(Interval(arrival_ns, sched), Interval(sched, max(sched, end_ns)), kv_load)


def queue_span(phases: Phases) -> Interval:
    """The queue as a span: up to the KV load when there was one (the load is its own span)."""
    if phases.kv_load is not None:
        return Interval(phases.queue.start_ns, max(phases.queue.start_ns,
                                                   phases.kv_load.start_ns))
    return phases.queue
