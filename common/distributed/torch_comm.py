"""Collectives through a torch.distributed process group (gloo on the CPU, NCCL on CUDA).

Lifecycle: rank 0 hosts the TCPStore (`make_store(is_master=True)` picks a free port); every
rank then calls `init_group`, which blocks until all ranks joined, and gets a
`TorchCommunicator` for its tensor-parallel group: the whole world without pipeline stages,
else its stage's T ranks (every rank creates every stage's subgroup, in stage order, as
torch.distributed requires). `close` destroys the groups.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

# A peer that died closes its sockets and gloo raises at once; this only bounds a peer that
# hangs (a forward step is far shorter).
COLLECTIVE_TIMEOUT_S = 300


def make_store(port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, is_master,
                         timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                         wait_for_workers=False)


def init_group(store: dist.Store, rank: int, world_size: int, device: str,
               tp_size: Optional[int] = None) -> "TorchCommunicator":
    """Join the world group; returns the communicator of this rank's tensor-parallel group
    (ranks [s*T, (s+1)*T) of stage s; tp_size None: the whole world)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    tp = tp_size or world_size
    if tp == world_size:
        return TorchCommunicator(rank, world_size)
    mine = None
    for first in range(0, world_size, tp):  # every rank creates every group, in order
        group = dist.new_group(list(range(first, first + tp)), timeout=timeout)
        if first <= rank < first + tp:
            mine = TorchCommunicator(rank - first, tp, group, first)
    return mine


class TorchCommunicator:
    def __init__(self, rank: int, world_size: int, group=None, root: int = 0):
        """rank, world_size: within `group` (None: the world); root: the global rank of the
        group's rank 0."""
        self.rank, self.world_size = rank, world_size
        self._group, self._root = group, root

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self._group)

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def gather_last_dim(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        t = t.contiguous()
        if t.device.type == "cuda":  # NCCL has no gather: all_gather, keep it on rank 0
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.all_gather(parts, t, group=self._group)
            return torch.cat(parts, dim=-1) if self.rank == 0 else None
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(t, parts, dst=self._root, group=self._group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def abort(self) -> None:
        pass  # a peer's sockets close when it exits; gloo then raises on its own

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
