"""What rank 0 and the tensor-parallel ranks tell each other about per-rank KV transfers
(docs/parallelism.md, "Per-rank transfers"): rank 0's `Transfer` orders, sent with a step,
and each rank's `TransferReport`, sent back. Typed, frozen, bounded values in common so the
step's message (SchedulerOutput) can carry them; connector/rank_transfers.py runs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.common.engine.kv_transfer import MAX_BLOCK_KEYS

Kind = Literal["save", "load"]
KEY_BYTES = 32  # a block key is a sha256 (the chained block hash)
MAX_TRANSFER_BLOCKS = MAX_BLOCK_KEYS  # a request's whole block table at most
MAX_REQUEST_ID = 256


@dataclass(frozen=True)
class BlockRef:
    key: bytes  # the block's chained hash (its last head object's store key)
    block_id: int  # where the block lives in every rank's cache

    def __post_init__(self):
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise ValueError(f"a block key is {KEY_BYTES} bytes")
        if self.block_id < 0:
            raise ValueError(f"block_id must be >= 0, got {self.block_id}")


def _check_request_id(rid: str) -> None:
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID:
        raise ValueError(f"request_id must be 1..{MAX_REQUEST_ID} characters")


def _check_kind(kind: str) -> None:
    if kind not in ("save", "load"):
        raise ValueError(f"kind must be save or load, got {kind!r}")


def _check_seq(seq: int) -> None:
    if type(seq) is not int or not 0 <= seq < 1 << 63:
        raise ValueError(f"seq must be an int in [0, 2**63), got {seq!r}")


@dataclass(frozen=True)
class Transfer:
    """Rank 0's order to every rank: move these blocks of one request, in this order. `seq`
    tells apart transfers of one request in flight at once (decode saves a block each step
    it fills): rank 0 numbers them, and the reports carry it back."""
    request_id: str
    kind: Kind
    blocks: tuple[BlockRef, ...]
    seq: int = 0

    def __post_init__(self):
        _check_request_id(self.request_id)
        _check_kind(self.kind)
        _check_seq(self.seq)
        if not 0 < len(self.blocks) <= MAX_TRANSFER_BLOCKS:
            raise ValueError(f"a transfer moves 1..{MAX_TRANSFER_BLOCKS} blocks")


@dataclass(frozen=True)
class TransferReport:
    """A rank's answer: its part of a transfer is over; `blocks`: leading blocks it stored
    (save) or installed (load)."""
    request_id: str
    kind: Kind
    rank: int
    blocks: int
    seq: int = 0  # its Transfer's

    def __post_init__(self):
        _check_request_id(self.request_id)
        _check_kind(self.kind)
        _check_seq(self.seq)
        for name in ("rank", "blocks"):
            if type(getattr(self, name)) is not int:  # a worker's message, unpickled
                raise ValueError(f"{name} must be an int")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if not 0 <= self.blocks <= MAX_TRANSFER_BLOCKS:
            raise ValueError(f"blocks must be 0..{MAX_TRANSFER_BLOCKS}, got {self.blocks}")
