"""Build the engine on a thread that exits, so its OpenMP team does not outlive the build.

libgomp gives every thread that starts a parallel region a team (and a pool of worker threads)
of its own, kept until that thread exits. An engine service loads the model and runs the
profiling forward at start-up, then steps on its engine thread: built on the main thread, the
process keeps two teams, main's idle and the engine thread's busy. libgomp then manages more
threads than the process has cores (on `--cpus 0,1` with 2 torch threads: 3 > 2) and
throttles its spin-wait from ~300,000 iterations to 100 (`gomp_throttled_spin_count_var`), so
a worker sleeps on a futex as soon as a parallel region ends and every region of every forward
pays a wake-up: the served decode step was about 1.4x the offline one at the same batch
(docs/served-performance.md). A thread that exits releases its team, so built here, the
engine thread's team is the only one left, as it is offline.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def run_on_exiting_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a new thread, joined (it exits, releasing any OpenMP team it made);
    returns its result or raises its exception. Blocks the caller meanwhile."""
    result: list = []
    error: list = []

    def run() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name="engine-build")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
