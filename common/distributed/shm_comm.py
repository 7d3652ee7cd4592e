"""All-reduce and gather-to-rank-0 through shared memory, for the ranks of one host.

Why: gloo moves every all-reduce through loopback TCP (tens to hundreds of microseconds per call
even for one row), and a tensor-parallel decode step does two per layer. Here each rank copies
its partial sum into its slot of a shared buffer, waits at a barrier, and sums every rank's slot
itself in rank order (so all ranks get bitwise the same result). vLLM's CPU backend does the same
for the same reason.

Buffers: one file in /dev/shm that rank 0 creates (`make_buffers`) and every worker maps
(`attach_buffers`); rank 0 unlinks it once all ranks mapped it, so nothing outlives them:
- data  float32 [2, world, slot]: two generations of slots. Call g uses buffer g % 2. A rank
  can only write buffer g % 2 again in call g + 2, which it reaches only after every rank
  arrived at call g + 1's barrier, i.e. after every rank finished reading call g. So one barrier
  per call suffices.
- ctrl  int64 [world + 1, 16]: row r, column 0 holds the last generation rank r arrived at
  (one cache line per rank, so ranks never write the same line); row `world` is the abort flag.

The barrier: each rank publishes its own generation counter and waits until every counter
reached it. This is the sense-reversing barrier with a monotone counter in place of the 1-bit
sense: a rank that already moved on to the next call cannot be mistaken for one that has not
arrived, and no shared fetch-and-add is needed. Ordering relies on x86's total store order (the
data copy is stored before the counter; loads are not reordered with loads).

While waiting a rank spins briefly, then yields its core (the machine is shared), and every few
milliseconds checks that its peers are alive (`peers_alive`) and that no rank raised the abort
flag; either ends the wait with PeerDiedError instead of a hang.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

_LINE = 16  # int64 per cache line (128 bytes: also keeps the adjacent-line prefetcher apart)
_SPIN = 200  # pure spins before yielding the core
_CHECK_S = 0.005  # how often a waiting rank looks at its peers


class PeerDiedError(RuntimeError):
    """A rank of the group died or aborted while this one waited in a collective."""


@dataclass(frozen=True)
class ShmBuffers:
    path: str
    ctrl: torch.Tensor  # int64 [world + 1, 16]
    data: torch.Tensor  # float32 [2, world, slot]

    def abort(self) -> None:
        """Raise the abort flag (as ShmCommunicator.abort) from a process outside the group
        (rank 0, for another pipeline stage's group)."""
        self.ctrl[self.ctrl.shape[0] - 1, 0] = 1


def _nbytes(world_size: int, slot_floats: int) -> tuple[int, int]:
    ctrl = (world_size + 1) * _LINE * 8
    return ctrl, ctrl + 2 * world_size * slot_floats * 4


def make_buffers(world_size: int, slot_floats: int) -> ShmBuffers:
    """A zeroed buffer file in /dev/shm (rank 0)."""
    fd, path = tempfile.mkstemp(prefix="pdserve-tp-", dir="/dev/shm")
    try:
        os.ftruncate(fd, _nbytes(world_size, slot_floats)[1])
    finally:
        os.close(fd)
    return attach_buffers(path, world_size, slot_floats)


def attach_buffers(path: str, world_size: int, slot_floats: int) -> ShmBuffers:
    ctrl_bytes, total = _nbytes(world_size, slot_floats)
    raw = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    ctrl = raw[:ctrl_bytes].view(torch.int64).view(world_size + 1, _LINE)
    data = raw[ctrl_bytes:].view(torch.float32).view(2, world_size, slot_floats)
    return ShmBuffers(path, ctrl, data)


class ShmCommunicator:
    def __init__(self, rank: int, world_size: int, ctrl: torch.Tensor, data: torch.Tensor,
                 peers_alive: Callable[[], bool], fallback):
        """`fallback`: a Communicator for what does not fit a slot (or is not fp32 CPU)."""
        self.rank, self.world_size = rank, world_size
        self._ctrl = ctrl.numpy()  # [world + 1, 16] view of the shared counters
        self._data = data
        self._slot = data.shape[2]
        self._peers_alive = peers_alive
        self._fallback = fallback
        self._gen = 0

    def _fits(self, t: torch.Tensor) -> bool:
        return (t.dtype == torch.float32 and t.device.type == "cpu" and t.numel() <= self._slot
                and t.is_contiguous())

    def all_reduce(self, t: torch.Tensor) -> None:
        if not self._fits(t):
            self._fallback.all_reduce(t)
            return
        n = t.numel()
        slots = self._publish(t)  # [world, slot]
        flat = t.view(-1)
        torch.add(slots[0, :n], slots[1, :n], out=flat)
        for r in range(2, self.world_size):
            flat.add_(slots[r, :n])

    def gather_last_dim(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        t = t.contiguous()
        if not self._fits(t):
            return self._fallback.gather_last_dim(t)
        slots = self._publish(t)
        if self.rank != 0:
            return None
        n = t.numel()
        return torch.cat([slots[r, :n].view(t.shape) for r in range(self.world_size)], dim=-1)

    def barrier(self) -> None:
        """A call with no data: the barrier of the next generation (its slots unused)."""
        self._gen += 1
        self._barrier(self._gen)

    def _publish(self, t: torch.Tensor) -> torch.Tensor:
        """Copy t into this rank's slot of the next generation and wait for every rank."""
        self._gen += 1
        slots = self._data[self._gen & 1]
        slots[self.rank, :t.numel()].copy_(t.view(-1))
        self._barrier(self._gen)
        return slots

    def _barrier(self, gen: int) -> None:
        ctrl = self._ctrl
        ctrl[self.rank, 0] = gen
        arrived = ctrl[:self.world_size, 0]
        spins = 0
        next_check = 0.0
        while (arrived < gen).any():
            spins += 1
            if spins < _SPIN:
                continue
            os.sched_yield()
            now = time.monotonic()
            if now >= next_check:
                if next_check and (ctrl[self.world_size, 0] or not self._peers_alive()):
                    raise PeerDiedError(f"rank {self.rank}: a peer died or aborted during a "
                                        "collective")
                next_check = now + _CHECK_S

    def abort(self) -> None:
        """Make every rank waiting in (or later entering) a barrier raise PeerDiedError."""
        self._ctrl[self.world_size, 0] = 1

    def close(self) -> None:
        self.abort()
        self._fallback.close()
