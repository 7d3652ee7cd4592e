"""Rank 0's end of per-rank KV transfers (docs/parallelism.md, "Per-rank transfers"): rank 0's
own `RankKV` over its caches, the executor that carries the workers' orders and reports, and
the tally (rank_kv_tally.py) that books a transfer finished once every rank reported it. What
to move is the connector's to decide (its per-rank mode); this moves the orders and the
reports, and is in common because EngineCore builds it (common never imports connector).

Lifecycle: built by `EngineCore` when it is given a `RankKVFactory` (the same factory the
workers got at spawn) -> `send(transfers)` starts transfers on every rank (a message with no
step; a save is sent after the forward that wrote its blocks, and each worker reads its socket
in order, so it runs the save after its own forward of that step) -> `poll()` between steps
for the finished ones -> `close()` before the executor closes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pdserve.common.distributed.executor import Executor, WorkerDiedError
from pdserve.common.distributed.rank_kv import RankKV
from pdserve.common.engine.kv_rank_messages import Transfer, TransferReport
from pdserve.common.engine.rank_kv_tally import Completions


@dataclass(frozen=True)
class Finished:
    transfer: Transfer
    blocks: int  # leading blocks every rank moved (a load recomputes from the next one)


class RankKVLink:
    def __init__(self, executor: Executor, world: int):
        self.executor = executor
        self.own: RankKV | None = None  # set by `attach` once built over rank 0's caches
        self.tally = Completions(world)
        self._open: dict[tuple[str, str, int], Transfer] = {}
        self._lock = threading.Lock()
        self._reports: list[TransferReport] = []  # rank 0's, from its I/O thread

    def attach(self, own: RankKV) -> None:
        self.own = own

    @property
    def open(self) -> int:
        """Transfers started and not yet reported by every rank."""
        return len(self._open)

    def on_report(self, report: TransferReport) -> None:
        """Rank 0's RankKV calls this on its I/O thread as each of its transfers ends."""
        with self._lock:
            self._reports.append(report)

    def send(self, transfers: tuple[Transfer, ...]) -> None:
        """Start transfers on every rank now, with no step."""
        if not transfers:
            return
        self._expect(transfers)
        self.executor.send_transfers(transfers)
        for t in transfers:
            self.own.start(t)

    def _expect(self, transfers: tuple[Transfer, ...]) -> None:
        if self.own is None:
            raise RuntimeError("rank 0's KV transfers are not built")
        keys = [(t.request_id, t.kind, t.seq) for t in transfers]
        if len(set(keys)) < len(keys) or any(k in self._open for k in keys):
            # refused before any rank starts any of them
            raise ValueError("a transfer of this request, kind and seq is already in flight")
        for k, t in zip(keys, transfers):
            self.tally.expect(t)
            self._open[k] = t

    def poll(self) -> list[Finished]:
        """The transfers every rank has now reported, without waiting. A report the tally
        refuses (a worker's message is not trusted) fails the engine like a dead worker."""
        with self._lock:
            reports, self._reports = self._reports, []
        reports += self.executor.poll_reports()
        done = []
        for r in reports:
            try:
                n = self.tally.add(r)
            except ValueError as exc:
                raise WorkerDiedError(f"rank {r.rank} sent a bad KV report: {exc}") from exc
            if n is not None:
                done.append(Finished(self._open.pop((r.request_id, r.kind, r.seq)), n))
        return done

    def close(self) -> None:
        own, self.own = self.own, None
        if own is not None:
            own.close()
