"""connector/serial_torch.py and the connector's IOThread: at 2 torch threads, a parallel torch
op on the I/O thread or its worker makes no OpenMP team (no thread beyond the two), while the
process-wide count, and a thread started afterwards, keep 2 threads and their team."""

import threading

import pytest
import torch

from pdserve.connector.io_thread import IOThread
from pdserve.connector.serial_torch import serial_torch_on_this_thread
from tests.unit.thread_helpers import settle as _settle
from tests.unit.thread_helpers import threads as _threads
from tests.unit.thread_helpers import torch_threads


def _parallel_op() -> int:
    """A KV-load-sized op above parallel_for's grain; returns this thread's torch count."""
    assert float(torch.ones(1 << 22).add_(1.0)[0]) == 2.0
    return torch.get_num_threads()


async def _on_loop() -> int:
    return _parallel_op()


@pytest.fixture
def two_torch_threads():
    with torch_threads(2):
        yield


def test_io_thread_and_its_worker_make_no_openmp_team(two_torch_threads):
    base = _threads()
    io = IOThread("test-io")
    try:
        assert io.run(_on_loop(), 30.0) == 1
        assert _settle(base, 1) == 1  # the I/O thread alone, no team worker

        async def offloaded() -> int:
            return await io.offload(_parallel_op)

        assert io.run(offloaded(), 30.0) == 1
        assert _settle(base, 2) == 2  # and its CPU worker, no team worker
    finally:
        io.close()
    # both go away (the worker exits after close returns: waited for, so the next test's
    # count starts from a settled process)
    assert _settle(base, 0) == 0
    assert torch.get_num_threads() == 2  # the process's count is untouched


def test_only_the_calling_thread_turns_serial(two_torch_threads):
    base = _threads()
    got: list = []
    done = [threading.Event(), threading.Event()]
    stop = threading.Event()

    def serial_then_wait():
        got.append((serial_torch_on_this_thread(), _parallel_op()))
        done[0].set()
        stop.wait()

    def parallel_then_wait():
        got.append(_parallel_op())
        done[1].set()
        stop.wait()

    threads = [threading.Thread(target=serial_then_wait),
               threading.Thread(target=parallel_then_wait)]
    try:
        threads[0].start()
        assert done[0].wait(30.0) and got == [(True, 1)]
        assert _settle(base, 1) == 1  # no team worker beside it
        threads[1].start()  # started later: still the process's 2 threads, and a team worker
        assert done[1].wait(30.0) and got[1] == 2
        assert _settle(base, 3) == 3
    finally:
        stop.set()
        for t in threads:
            if t.ident is not None:
                t.join()
    assert _settle(base, 0) == 0
