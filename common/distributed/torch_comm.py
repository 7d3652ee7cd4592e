"""Collectives through a torch.distributed process group (gloo on the CPU, NCCL on CUDA).

Lifecycle: rank 0 hosts the TCPStore (`make_store(is_master=True)` picks a free port); every
rank then calls `init_group`, which blocks until all ranks joined, and gets a
`TorchCommunicator`. `close` destroys the group.
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


def init_group(store: dist.Store, rank: int, world_size: int, device: str
               ) -> "TorchCommunicator":
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TorchCommunicator(rank, world_size)


class TorchCommunicator:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t)

    def gather_last_dim(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        t = t.contiguous()
        if t.device.type == "cuda":  # NCCL has no gather: all_gather, keep it on rank 0
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.all_gather(parts, t)
            return torch.cat(parts, dim=-1) if self.rank == 0 else None
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def abort(self) -> None:
        pass  # a peer's sockets close when it exits; gloo then raises on its own

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
