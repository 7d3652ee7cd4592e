"""What the C heap does with the memory an engine step frees: keep it for the next step.

Why: a CPU step allocates its activations through torch's CPU allocator, which is plain
malloc. A prefill step of 2,048 tokens allocates and frees tens of MB per layer (SmolLM2: the
qkv, gate/up and down outputs, 5-13 MB each; the packed path's expanded weight, up to 7 MB per
matrix). glibc hands blocks above its mmap threshold back to the kernel on free (munmap) and
trims the heap's free top above its trim threshold, so the next layer's allocation gets fresh
pages, which the kernel zeroes and faults in one 4 KiB page at a time. Measured on the 2-core
Zen 5 (docs/served-performance.md, "The C heap"): ~560,000 page faults and 0.9-2.2 s of
system time per 64 x 256-token prefill run offline, none with the heap kept; the batch-64
offline run ran 1.17x faster with packed weights and 1.06x with fp32 weights. (A served
engine steps on its own thread, whose arena faulted far less: served throughput unchanged.)

`keep_freed_memory()` raises glibc's mmap threshold to its ceiling (32 MiB on 64-bit) and
never trims the heap: what a step frees stays in the process for the next step. The cost is
that the process stays at its activation peak after a burst, which is what the memory plan
already budgets for (startup.py measures that peak and the KV cache gets the rest).
Allocations above 32 MiB are still mapped and unmapped each time. Process-wide and
idempotent; a no-op where the C library is not glibc (musl, macOS), reported by the return
value.
"""

from __future__ import annotations

import ctypes
import logging
import platform

from pdserve.common.config import HOST_HEAP_MODES

logger = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX: 4 MiB * sizeof(long))
MMAP_THRESHOLD_MAX = 32 << 20
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def is_glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed blocks up to 32 MiB in the heap and never trim it; True when
    applied, False where the C library is not glibc or refused a setting."""
    if not is_glibc():
        logger.info("host heap: not glibc (%s); allocator settings left as they are",
                    platform.libc_ver()[0] or "unknown")
        return False
    libc = ctypes.CDLL(None)
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1)
    if not ok:
        logger.warning("host heap: glibc refused mallopt; freed activations go back to the "
                       "kernel as before")
    return ok


def apply_host_heap(mode: str) -> bool:
    """`mode` "keep": keep_freed_memory(); "release": glibc's defaults, untouched. Returns
    whether the heap is now kept."""
    if mode not in HOST_HEAP_MODES:
        raise ValueError(f"host_heap must be one of {', '.join(HOST_HEAP_MODES)}, got {mode!r}")
    return keep_freed_memory() if mode == "keep" else False
