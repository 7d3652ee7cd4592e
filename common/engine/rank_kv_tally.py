"""Rank 0's tally of per-rank KV transfer reports (docs/parallelism.md, "Per-rank transfers",
step 4): a transfer is finished when every rank of the engine reported it, with the block count
the smallest any rank reached (a load recomputes from the first block some rank missed; a save
is over, whatever stored, once no rank still reads the blocks). In common, beside the
messages, because rank 0's engine side (rank_kv_link.py) keeps it; connector/rank_transfers.py
runs the transfers themselves."""

from __future__ import annotations

from typing import Optional

from pdserve.common.engine.kv_rank_messages import Transfer, TransferReport


class Completions:
    """Rank 0's tally: a transfer is finished when every one of `world` ranks reported it."""

    def __init__(self, world: int):
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world = world
        # (request id, kind, seq) -> (blocks ordered, {rank: blocks it reported})
        self._open: dict[tuple[str, str, int], tuple[int, dict[int, int]]] = {}

    def expect(self, t: Transfer) -> None:
        """A transfer rank 0 just sent to every rank (one per request, kind and seq at a
        time)."""
        k = (t.request_id, t.kind, t.seq)
        if k in self._open:
            raise ValueError(f"{t.kind} {t.seq} of {t.request_id!r} is already in flight")
        self._open[k] = (len(t.blocks), {})

    @property
    def open(self) -> int:
        return len(self._open)

    def add(self, r: TransferReport) -> Optional[int]:
        """Book one rank's report; the finished transfer's block count (the smallest over
        ranks) once it is the last rank's, else None. A report nobody expects, from a rank
        outside the engine, for more blocks than ordered, or a rank's second report is
        refused (ValueError): a worker's message is not trusted blindly. The report is
        checked again here: unpickling a dataclass does not run its __post_init__."""
        r = TransferReport(r.request_id, r.kind, r.rank, r.blocks, r.seq)
        if not 0 <= r.rank < self.world:
            raise ValueError(f"report from rank {r.rank} of {self.world}")
        k = (r.request_id, r.kind, r.seq)
        if k not in self._open:
            raise ValueError(f"no {r.kind} {r.seq} of {r.request_id!r} is in flight")
        ordered, got = self._open[k]
        if r.blocks > ordered or r.rank in got:
            raise ValueError(f"rank {r.rank}: bad report {r}")
        got[r.rank] = r.blocks
        if len(got) < self.world:
            return None
        del self._open[k]
        return min(got.values())
