"""Request timelines observed between engine steps, and the phases computed from them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.common.engine.request import RequestStatus as S
from pdserve.services.engine_host.phases import queue_span, request_phases
from pdserve.services.engine_host.request_timeline import RequestTimeline, TimelineTracker


def _core(**reqs):
    return SimpleNamespace(get_request=dict(reqs).get)  # the EngineClient method it uses


def _req(n_tokens=4, status=S.WAITING, ext=0):
    return SimpleNamespace(status=status, all_token_ids=list(range(n_tokens)),
                           num_external_tokens=ext)


def test_tracker_stamps_kv_wait_schedule_and_first_token():
    r = _req()
    tracker = TimelineTracker(_core(a=r))
    tl = RequestTimeline()
    tracker.watch("a", tl)
    assert tl.accepted_ns > 0 and len(tracker) == 1
    tracker.observe(100, 110)  # still WAITING: nothing
    assert (tl.kv_wait_start_ns, tl.scheduled_ns) == (0, 0)
    r.status, r.num_external_tokens = S.WAITING_FOR_KV, 32
    tracker.observe(200, 210)
    tracker.observe(300, 310)  # still loading: the start stays
    assert (tl.kv_wait_start_ns, tl.kv_tokens, tl.kv_wait_end_ns) == (200, 32, 0)
    r.status = S.RUNNING  # loaded, scheduled and computed in the step starting at 400
    r.all_token_ids.append(9)
    tracker.observe(400, 450)
    assert (tl.kv_wait_end_ns, tl.scheduled_ns, tl.first_token_ns) == (400, 400, 450)
    assert len(tracker) == 0  # done: no more per-step work for it
    r.status = S.FINISHED
    tracker.observe(500, 510)
    assert tl.scheduled_ns == 400  # not re-stamped


def test_tracker_forgets_and_drops_cancelled_and_unknown():
    a, b = _req(), _req()
    tracker = TimelineTracker(_core(a=a, b=b))
    tla, tlb, tlc = RequestTimeline(), RequestTimeline(), RequestTimeline()
    tracker.watch("a", tla)
    tracker.watch("b", tlb)
    tracker.watch("c", tlc)  # not in the scheduler table: accept stamp only
    assert len(tracker) == 2 and tlc.accepted_ns > 0
    b.status = S.CANCELLED
    tracker.observe(1, 2)
    assert len(tracker) == 1
    tracker.forget("a")
    assert len(tracker) == 0
    assert TimelineTracker(_core()).__len__() == 0  # a core with no requests


def test_prefill_phases():
    tl = RequestTimeline(accepted_ns=1_000, scheduled_ns=3_000, first_token_ns=7_000)
    p = request_phases(tl, arrival_ns=500, end_ns=9_000, first_token_ends_compute=True)
    assert p.queue_s == pytest.approx(2_500e-9)
    assert p.compute.seconds == pytest.approx(4_000e-9)
    assert p.kv_save.seconds == pytest.approx(2_000e-9)
    assert p.kv_load is None and queue_span(p) == p.queue


def test_decode_phases_subtract_the_kv_load_from_the_queue():
    tl = RequestTimeline(accepted_ns=1_000, kv_wait_start_ns=2_000, kv_wait_end_ns=6_000,
                         scheduled_ns=6_000, first_token_ns=7_000)
    p = request_phases(tl, arrival_ns=1_000, end_ns=20_000, first_token_ends_compute=False)
    assert p.kv_load.seconds == pytest.approx(4_000e-9)
    assert p.queue_s == pytest.approx(1_000e-9)  # 5 us queued, 4 us of it loading
    assert p.compute.seconds == pytest.approx(14_000e-9) and p.kv_save is None
    span = queue_span(p)
    assert (span.start_ns, span.end_ns) == (1_000, 2_000)


def test_unseen_schedule_gives_no_phases_and_clocks_never_go_negative():
    assert request_phases(RequestTimeline(accepted_ns=5), 1, 9, True) is None
    # a scheduled stamp before the RPC's own arrival stamp (different threads): clamp
    p = request_phases(RequestTimeline(scheduled_ns=90, first_token_ns=95), arrival_ns=100,
                       end_ns=99, first_token_ends_compute=True)
    assert p.queue_s == 0 and p.compute.seconds == 0 and p.kv_save.seconds == 0
    # a KV wait stamped before arrival and ending after the schedule stays inside the queue
    p = request_phases(RequestTimeline(kv_wait_start_ns=50, kv_wait_end_ns=400,
                                       scheduled_ns=300), arrival_ns=100, end_ns=500,
                       first_token_ends_compute=False)
    assert (p.kv_load.start_ns, p.kv_load.end_ns) == (100, 300)
    assert p.queue_s == 0 and p.compute.seconds == pytest.approx(200e-9)
