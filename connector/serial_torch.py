"""Make torch run serially on the calling thread (a connector thread), process setting untouched.

libgomp gives every thread that enters a parallel region a team of its own, kept until the
thread exits (services/engine_host/build_thread.py). The connector's I/O thread and its worker
run ATen ops big enough for parallel_for (a load's index_copy_ into the KV cache: 16 blocks x
6,144 floats a layer; a backfill's stack and payload copy): in an engine at more than one torch
thread each of them would keep a second team beside the engine thread's, libgomp would then
manage more threads than there are cores and throttle its spin-wait, and every parallel region
of every forward would pay a futex wake-up. At one torch thread ATen never opens a region, so
this changes nothing there.

`torch.set_num_threads(1)` is no answer: it also sets the process-wide count that every thread
started later takes (the engine thread included). OpenMP's own `omp_set_num_threads` sets only
the calling thread's count, and ATen reads that one (`at::get_num_threads()` is
`omp_get_max_threads()`), so: let ATen do its once-per-thread initialisation first (it would
overwrite the count), then set this thread's to 1 in the libgomp torch loaded.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch


def _loaded_libgomp() -> Optional[ctypes.CDLL]:
    """The libgomp this process mapped (torch's), or None (another OpenMP, or none)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(None, 1)[-1]
            if os.path.basename(path).startswith("libgomp") and os.path.isabs(path):
                return ctypes.CDLL(path)
    return None


def serial_torch_on_this_thread() -> bool:
    """ATen ops on the calling thread run serially from now on (no OpenMP team is made for
    it); other threads and the process-wide count keep theirs. False when torch's OpenMP
    runtime is not libgomp (nothing changed then)."""
    torch.get_num_threads()  # ATen's per-thread init: sets this thread's count from the process's
    if torch.get_num_threads() == 1:
        return True
    try:
        gomp = _loaded_libgomp()
    except OSError:
        return False
    if gomp is None:
        return False
    gomp.omp_set_num_threads(1)
    return torch.get_num_threads() == 1
