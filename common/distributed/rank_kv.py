"""What a tensor-parallel worker needs to move its own heads' KV through the store, as
Protocols: common never imports connector, so the engine hands each worker a picklable
`RankKVFactory` in its WorkerSpec (connector/rank_kv_factory.py implements it) and the worker
builds its `RankKV` over its own caches (docs/parallelism.md, "Per-rank transfers").

Lifecycle: `build` once the worker's caches exist (it opens the worker's own store client);
`start(transfer)` for each transfer a step's message carries, after that step's forward;
each finished transfer's report goes to `on_report` on the RankKV's I/O thread (the worker
sends it to rank 0 at once: its step loop may be blocked waiting for the next step);
`close` when the worker stops.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from pdserve.common.distributed.layout import RankPlace
from pdserve.common.engine.kv_rank_messages import Transfer, TransferReport


class RankKV(Protocol):
    def start(self, transfer: Transfer) -> None: ...

    def close(self) -> None: ...


class RankKVFactory(Protocol):
    def build(self, caches: list[torch.Tensor], place: RankPlace,
              on_report: Callable[[TransferReport], None]) -> RankKV:
        """caches[l]: this rank's cache of layer l, [2, blocks, block_size, its heads, d]."""
