"""services/engine_host/build_thread.py: the build runs on a thread that exits, and the OpenMP
team a parallel torch op made there goes with it (a live thread keeps its team's worker)."""

import os
import threading
import time

import pytest
import torch

from pdserve.services.engine_host.build_thread import run_on_exiting_thread


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settle(expected: int, timeout_s: float = 5.0) -> int:
    """The thread count once it reaches `expected` (exiting threads take a moment)."""
    end = time.monotonic() + timeout_s
    while _threads() != expected and time.monotonic() < end:
        time.sleep(0.01)
    return _threads()


def _parallel_op() -> float:
    return float(torch.ones(1 << 22).add_(1.0)[0])  # above parallel_for's grain: a team


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of 2 even on 1 core: one worker thread
    yield
    torch.set_num_threads(before)


def test_returns_the_result_on_another_thread_and_raises_its_error():
    assert run_on_exiting_thread(lambda a, b: (a + b, threading.current_thread().name),
                                 1, 2) == (3, "engine-build")
    with pytest.raises(KeyError, match="nope"):
        run_on_exiting_thread(lambda: {}["nope"])


def test_the_team_of_the_build_thread_is_gone_but_a_live_thread_keeps_its(two_torch_threads):
    base = _threads()
    assert run_on_exiting_thread(_parallel_op) == 2.0
    assert _settle(base) == base  # neither the build thread nor its OpenMP worker is left
    stop = threading.Event()
    live = threading.Thread(target=lambda: (_parallel_op(), stop.wait()))
    live.start()
    try:
        assert _settle(base + 2) == base + 2  # the thread and its team's worker
    finally:
        stop.set()
        live.join()
    assert _settle(base) == base
