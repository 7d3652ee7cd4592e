"""Counting this process's threads (OpenMP team workers included) for the tests that assert
which threads keep an OpenMP team."""

import contextlib
import os
import time

import torch


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settle(expected: int, timeout_s: float = 5.0) -> int:
    """The thread count once it reaches `expected` (starting/exiting threads take a moment)."""
    end = time.monotonic() + timeout_s
    while threads() != expected and time.monotonic() < end:
        time.sleep(0.01)
    return threads()


@contextlib.contextmanager
def torch_threads(n: int):
    """torch at n threads inside (at 2 a team has one worker thread, even on 1 core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
