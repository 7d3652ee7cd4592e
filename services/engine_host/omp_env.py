"""How long torch's OpenMP workers spin between parallel regions, in an engine process.

libgomp (torch's OpenMP on Linux) lets a worker busy-wait 300,000 iterations (several ms on
these CPUs) after each parallel region before it sleeps. Offline that is harmless. Served, the
engine thread leaves torch often for longer than that: it waits for the GIL while the event
loop streams the last step's outputs, samples, builds outputs, and idles between requests; a
spinning worker then holds a core that the event loop, the router and the clients need, and
they take it from the forward instead. 10,000 iterations still spans the gap between two torch
ops of a forward (tens of microseconds of Python), so the forward keeps its warm workers.

It is read once, when libgomp loads (`import torch`), so the service sets it before that, in
its environment (tensor-parallel workers inherit it). A value the user set (GOMP_SPINCOUNT or
OMP_WAIT_POLICY) is left as it is. Torch-free on purpose.
"""

from __future__ import annotations

from typing import MutableMapping

SPIN_COUNT = 10_000  # libgomp's default is 300,000 (OMP_WAIT_POLICY unset)
_USER_KNOBS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def set_engine_omp_env(environ: MutableMapping[str, str]) -> bool:
    """Sets GOMP_SPINCOUNT in `environ` unless the user chose a spin policy; True if it did."""
    if any(k in environ for k in _USER_KNOBS):
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True
