"""The served-path breakdown's arithmetic (bench/serve_profile.py)."""

import pytest

from pdserve.bench.serve_profile import delta_breakdown
from pdserve.common.engine.step_profile import PHASES, StepProfile


def test_breakdown_is_per_step_over_the_window():
    p = StepProfile()
    p.add_step(64, 64, 0, 1_000_000, 41_000_000, 43_000_000, 44_000_000)
    before = p.snapshot()
    for _ in range(4):
        p.add_step(32, 32, 0, 2_000_000, 32_000_000, 36_000_000, 37_000_000)
    p.send_ns += 8_000_000
    p.num_messages += 128
    b = delta_breakdown(before, p.snapshot())
    assert (b.num_steps, b.num_sampled, b.num_messages) == (4, 128, 128)
    assert b.ms_per_step["schedule"] == 2.0 and b.ms_per_step["forward"] == 30.0
    assert b.ms_per_step["sample"] == 4.0 and b.ms_per_step["update"] == 1.0
    assert b.ms_per_step["send"] == 2.0 and set(b.ms_per_step) == set(PHASES)
    assert b.step_ms == 37.0


def test_an_idle_window_is_refused():
    s = StepProfile().snapshot()
    with pytest.raises(ValueError, match="no engine step"):
        delta_breakdown(s, s)


def test_cpu_fields_are_per_step_and_absent_ones_read_zero():
    p = StepProfile()
    before = dict(p.snapshot(), step_cpu_ns=0, loop_cpu_ns=5_000_000)
    for _ in range(2):
        p.add_step(8, 8, 0, 0, 10_000_000, 10_000_000, 10_000_000)
    after = dict(p.snapshot(), step_cpu_ns=16_000_000, loop_cpu_ns=9_000_000)
    b = delta_breakdown(before, after)  # process_cpu_ns missing: an older engine
    assert b.cpu_ms_per_step == {"step_cpu": 8.0, "loop_cpu": 2.0, "process_cpu": 0.0}


def test_process_cpu_reads_this_process():
    import os
    import time

    from pdserve.bench.serve_profile import process_cpu_s

    t = process_cpu_s(os.getpid())
    assert t > 0 and abs(t - time.process_time()) < 0.5


def test_the_window_waits_for_the_first_step(monkeypatch):
    import time
    from types import SimpleNamespace

    from pdserve.bench import serve_profile

    counts = iter([5, 5, 5, 6, 7])
    monkeypatch.setattr(serve_profile, "_snapshot", lambda *a: {"num_steps": next(counts)})
    args = SimpleNamespace(engine="x", tls_dir="", engine_role="decode")
    serve_profile.wait_for_a_step(args, time.monotonic() + 60, poll_s=0)
    assert next(counts) == 7  # returned on the first moved count (6), no further poll
    idle = iter([3] * 1000)
    monkeypatch.setattr(serve_profile, "_snapshot", lambda *a: {"num_steps": next(idle)})
    serve_profile.wait_for_a_step(args, time.monotonic() - 1, poll_s=0)  # past the deadline
    assert next(idle) == 3 and len(list(idle)) == 998  # one snapshot, no poll
