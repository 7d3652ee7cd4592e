"""`EngineConfig.host_heap`: a CPU engine keeps the memory a step frees (common/host_heap.py).

The allocator setting is process-wide, so each case runs in a fresh interpreter. What it
checks there: a 16 MiB block freed and allocated again is faulted in again under glibc's
defaults (the first one is mapped, unmapped on free, and the second comes from fresh heap
pages), and not after an engine started with host_heap "keep" (the block stays in the heap).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.host_heap import apply_host_heap, is_glibc

# Starts a tiny CPU engine with the given host_heap, then prints the page faults of touching a
# freshly allocated 16 MiB block after a first one was freed.
PROBE = """
import ctypes, resource, sys
from pdserve.common.config import CacheConfig, EngineConfig
from pdserve.common.engine.engine_core import EngineCore

EngineCore(EngineConfig(model="tiny", num_threads=1, host_heap=sys.argv[1],
                        cache=CacheConfig(num_blocks=16)))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 16 << 20

def touch_fresh_block():
    p = libc.malloc(size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ctypes.memset(p, 1, size)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(p)
    return faults

touch_fresh_block()
print(touch_fresh_block())
"""


def _second_block_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_keep_reuses_freed_blocks_and_release_faults_them_in_again():
    if not is_glibc():  # the setting is glibc's; elsewhere keep says it did nothing
        assert apply_host_heap("keep") is False
        return
    pages = (16 << 20) // 4096
    assert _second_block_faults("release") >= pages // 2  # glibc's default: fresh pages
    assert _second_block_faults("keep") < 16  # the freed block, already resident


def test_modes_are_validated():
    with pytest.raises(ValueError, match="host_heap"):
        EngineConfig(host_heap="never")
    with pytest.raises(ValueError, match="host_heap"):
        apply_host_heap("trim")
