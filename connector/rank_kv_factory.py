"""The picklable factory a tensor-parallel worker gets in its WorkerSpec to build its own
per-rank transfers (common/distributed/rank_kv.py): its own I/O thread and store client,
opened in the worker from settings that hold paths, never secret material; the block MAC key
comes from the client (read from the block secret file there), not from the spec."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from pdserve.common.distributed.layout import RankPlace, kv_head_range
from pdserve.common.engine.kv_rank_messages import TransferReport
from pdserve.connector.codec import BlockCodec
from pdserve.connector.head_objects import HeadObjects, RankHeads
from pdserve.connector.io_thread import IOThread
from pdserve.connector.rank_transfers import RankTransfers

_OPEN_TIMEOUT_S = 30.0


class StoreOpener(Protocol):
    """Picklable store settings (services' KVStoreSettings)."""

    async def open_client(self):
        """A store client (BlockStore with `mac_key` and `async close()`) on this loop."""


class OwnedRankTransfers(RankTransfers):
    """RankTransfers that owns its I/O thread and store client: `close` stops both."""

    def close(self) -> None:
        try:
            self.io.run(self.store.close(), 5.0)
        except Exception:  # noqa: BLE001 - already broken: the thread stops anyway
            pass
        self.io.close()


@dataclass(frozen=True)
class RankTransfersFactory:
    opener: StoreOpener
    codec: BlockCodec  # the whole block's geometry; its mac_key is replaced by the client's
    lease_s: float = 30.0
    load_timeout_s: float = 10.0
    max_inflight: int = 8

    def build(self, caches: list[torch.Tensor], place: RankPlace,
              on_report: Callable[[TransferReport], None]) -> OwnedRankTransfers:
        if place.pp_size != 1:  # a rank's objects would hold only its stage's layers
            raise NotImplementedError("per-rank KV transfers with pipeline stages")
        offset, count = kv_head_range(self.codec.num_kv_heads, place.tp_rank, place.tp_size)
        if caches and caches[0].shape[3] != count:
            raise ValueError(f"rank {place.rank}'s caches hold {caches[0].shape[3]} heads, "
                             f"expected {count}")
        io = IOThread(f"kv-rank{place.rank}-io")
        try:
            client = io.run(self.opener.open_client(), _OPEN_TIMEOUT_S)
        except BaseException:
            io.close()
            raise
        codec = dataclasses.replace(self.codec, mac_key=client.mac_key)
        return OwnedRankTransfers(RankHeads(HeadObjects(codec), caches, offset), client, io,
                                  place.rank, self.lease_s, self.load_timeout_s,
                                  self.max_inflight, on_report)
