"""Run a bench's ranks as fresh interpreters on one host and read rank 0's JSON result.

Shared by the CPU communication benches (bench/allreduce_cpu.py, bench/offline_pp_handoff.py):
each needs a free port for rank 0's gloo store, one shared-memory buffer file for the ranks,
and a file where rank 0 writes what it measured. The buffer file is removed however the ranks
end; a rank that fails is an error, never a partial result.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from typing import Callable, Sequence


def run_ranks(world: int, slot_elems: int,
              argv: Callable[[int, int, str, str], Sequence[str]], what: str):
    """argv(rank, port, shm_path, out_path) -> the command of that rank; returns the JSON
    rank 0 wrote to out_path. `what` names the ranks in the error."""
    from pdserve.common.distributed.shm_comm import make_buffers
    from pdserve.services.ports import free_port

    port = free_port()
    bufs = make_buffers(world, slot_elems)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        try:
            procs = [subprocess.Popen(list(argv(r, port, bufs.path, out.name)))
                     for r in range(world)]
            codes = [p.wait() for p in procs]
        finally:
            os.unlink(bufs.path)
        if any(codes):
            raise RuntimeError(f"{what} rank failed (exit codes {codes})")
        with open(out.name) as f:
            return json.load(f)
