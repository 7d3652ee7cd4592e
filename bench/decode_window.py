"""The decode-only window of a saturated run, found from the engine's own counters.

A fixed `--delay` / `--duration` after the first step guesses where a run's prefill ends and
where the run ends; on a faster machine the guess overshoots (serve_matrix.sh's 30 s + 30 s
measured the next run, a rate-2 one, beside a 22 s saturated run). Instead, poll the engine's
StepProfile counters and keep the span from the first poll interval whose steps were all
decode-only (every computed token a sampled one: no prompt chunk rode in them) to the last
poll at which steps still ran before the run went idle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic() of the poll
    counters: dict  # StepProfile counters ({field: int}), as serve_profile reads them
    router_cpu_s: float  # a local router's CPU seconds then (0 when none is watched)

    def __post_init__(self):
        for k in ("num_steps", "num_tokens", "num_sampled"):
            if k not in self.counters:
                raise ValueError(f"counters lack {k}")


def _moved(a: Sample, b: Sample) -> int:
    return b.counters["num_steps"] - a.counters["num_steps"]


def _decode_only(a: Sample, b: Sample) -> bool:
    tokens = b.counters["num_tokens"] - a.counters["num_tokens"]
    sampled = b.counters["num_sampled"] - a.counters["num_sampled"]
    return _moved(a, b) > 0 and tokens == sampled


def decode_window(samples: Sequence[Sample]) -> tuple[Sample, Sample]:
    """(first, last): first = the start of the first decode-only interval, last = the last
    sample that ended an interval with steps in it. ValueError when no interval was
    decode-only (the run never left its prefill, or no run was polled)."""
    start = next((i for i in range(len(samples) - 1)
                  if _decode_only(samples[i], samples[i + 1])), None)
    if start is None:
        raise ValueError("no decode-only interval polled: was a run's decode phase in it?")
    end = max(j for j in range(start + 1, len(samples))
              if _moved(samples[j - 1], samples[j]) > 0)
    return samples[start], samples[end]


def poll(read: Callable[[], Sample], max_s: float, poll_s: float,
         idle_polls: int = 2) -> list[Sample]:
    """Samples every poll_s until a decode-only interval was seen and then idle_polls
    intervals in a row ran no step (the run ended; a next run's client takes longer than
    that to start and finish its first step), or max_s passed. An idle stretch before the
    decode phase (the client starting, a slow prefill step) does not stop it."""
    samples = [read()]
    deadline = samples[0].t + max_s
    decoding, idle = False, 0
    while samples[-1].t < deadline and not (decoding and idle >= idle_polls):
        time.sleep(poll_s)
        samples.append(read())
        decoding = decoding or _decode_only(samples[-2], samples[-1])
        idle = 0 if _moved(samples[-2], samples[-1]) > 0 else idle + 1
    return samples
