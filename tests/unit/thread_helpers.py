"""Counting this process's threads (OpenMP team workers included) for the tests that assert
which threads keep an OpenMP team."""

import contextlib
import os
import time

import torch


def threads() -> frozenset[str]:
    """This process's thread ids now."""
    return frozenset(os.listdir("/proc/self/task"))


def settle(base: frozenset[str], expected: int, timeout_s: float = 5.0) -> int:
    """How many threads not in `base` are alive, once that count reaches `expected` (starting
    and exiting threads take a moment). Counted against `base`'s ids, not its size, so a
    thread an earlier test left exiting cannot shift the count."""
    end = time.monotonic() + timeout_s
    while len(threads() - base) != expected and time.monotonic() < end:
        time.sleep(0.01)
    return len(threads() - base)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch at n threads inside (at 2 a team has one worker thread, even on 1 core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
