"""bench/decode_window.py: the decode-only span of a run, from polled engine counters."""

import pytest

from pdserve.bench.decode_window import Sample, decode_window, poll


def s(t, steps, tokens, sampled, router=0.0):
    return Sample(t, {"num_steps": steps, "num_tokens": tokens, "num_sampled": sampled}, router)


# idle, prefill (chunks of 2048 prompt tokens, a few samples), decode at batch 64, then idle
RUN = [s(0, 0, 0, 0), s(1, 0, 0, 0), s(2, 2, 4096, 2), s(3, 4, 8192, 20),
       s(4, 14, 8832, 660), s(5, 24, 9472, 1300), s(6, 30, 9856, 1684),
       s(7, 30, 9856, 1684), s(8, 30, 9856, 1684)]


def test_window_opens_at_the_first_decode_only_interval_and_closes_at_the_last_step():
    first, last = decode_window(RUN)
    assert (first.t, last.t) == (3, 6)


def test_a_step_with_prompt_tokens_is_not_decode_only():
    # one prompt token more in 3 -> 4 (every later count shifted by it): that interval had a
    # prompt chunk, the window opens a second later
    run = RUN[:4] + [s(x.t, x.counters["num_steps"], x.counters["num_tokens"] + 1,
                       x.counters["num_sampled"]) for x in RUN[4:]]
    assert decode_window(run)[0].t == 4 and decode_window(run)[1].t == 6


def test_a_run_that_never_left_prefill_is_refused():
    with pytest.raises(ValueError, match="decode-only"):
        decode_window(RUN[:4])
    with pytest.raises(ValueError):
        decode_window([s(0, 0, 0, 0)] * 3)  # idle intervals are not decode-only
    with pytest.raises(ValueError):
        Sample(0, {"num_steps": 1}, 0.0)


def test_poll_stops_once_the_decode_phase_went_idle(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda _: None)
    # (steps, prompt tokens so far): idle while the client starts, a prefill step, a slow
    # one (idle polls before decode do not stop it), decode, one idle poll inside the decode
    # phase (tolerated), decode, then the run's end; a next run's steps are never read
    trace = [(0, 0), (0, 0), (0, 0), (1, 2048), (1, 2048), (1, 2048), (1, 2048), (2, 4096),
             (5, 4096), (5, 4096), (8, 4096), (8, 4096), (8, 4096), (9, 6144)]
    it, clock = iter(trace), iter(range(100))

    def read():
        steps, prompt = next(it)
        return s(next(clock), steps, prompt + steps, steps)

    got = poll(read, max_s=50, poll_s=0.1, idle_polls=2)
    assert [x.counters["num_steps"] for x in got] == [0, 0, 0, 1, 1, 1, 1, 2, 5, 5, 8, 8, 8]
    first, last = decode_window(got)
    assert (first.t, last.t) == (7, 10)


def test_poll_stops_at_its_deadline_when_nothing_runs(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda _: None)
    clock = iter(range(100))
    got = poll(lambda: s(next(clock), 0, 0, 0), max_s=5, poll_s=0.1)
    assert [x.t for x in got] == [0, 1, 2, 3, 4, 5]
