"""services/engine_host/build_thread.py: the build runs on a thread that exits, and the OpenMP
team a parallel torch op made there goes with it (a live thread keeps its team's worker)."""

import threading

import pytest
import torch

from pdserve.services.engine_host.build_thread import run_on_exiting_thread
from tests.unit.thread_helpers import settle as _settle
from tests.unit.thread_helpers import threads as _threads
from tests.unit.thread_helpers import torch_threads


def _parallel_op() -> float:
    return float(torch.ones(1 << 22).add_(1.0)[0])  # above parallel_for's grain: a team


@pytest.fixture
def two_torch_threads():
    with torch_threads(2):
        yield


def test_returns_the_result_on_another_thread_and_raises_its_error():
    assert run_on_exiting_thread(lambda a, b: (a + b, threading.current_thread().name),
                                 1, 2) == (3, "engine-build")
    with pytest.raises(KeyError, match="nope"):
        run_on_exiting_thread(lambda: {}["nope"])


def test_the_team_of_the_build_thread_is_gone_but_a_live_thread_keeps_its(two_torch_threads):
    base = _threads()
    assert run_on_exiting_thread(_parallel_op) == 2.0
    assert _settle(base, 0) == 0  # neither the build thread nor its OpenMP worker is left
    stop = threading.Event()
    live = threading.Thread(target=lambda: (_parallel_op(), stop.wait()))
    live.start()
    try:
        assert _settle(base, 2) == 2  # the thread and its team's worker
    finally:
        stop.set()
        live.join()
    assert _settle(base, 0) == 0
