"""Rank 0's end of per-rank KV transfers (docs/parallelism.md, "Per-rank transfers"): rank 0's
own `RankKV` over its caches, and the executor that carries the workers' transfers and
reports. What to move and the tally of reports (connector/rank_transfers.py's `Completions`)
belong to the connector; this only moves the orders and the reports, since common never
imports connector.

Lifecycle: built by `EngineCore` when it is given a `RankKVFactory` (the same factory the
workers got at spawn) -> `send(transfers)` for transfers that start with no step (every rank
now) or `after_forward(transfers)` for those a step's `SchedulerOutput` carried (the workers
start theirs from the step's message; rank 0 after its own forward) -> `poll()` between steps
-> `close()` before the executor closes.
"""

from __future__ import annotations

import threading

from pdserve.common.distributed.executor import Executor
from pdserve.common.distributed.rank_kv import RankKV
from pdserve.common.engine.kv_rank_messages import Transfer, TransferReport


class RankKVLink:
    def __init__(self, executor: Executor):
        self.executor = executor
        self.own: RankKV | None = None  # set by `attach` once built over rank 0's caches
        self._lock = threading.Lock()
        self._reports: list[TransferReport] = []  # rank 0's, from its I/O thread

    def attach(self, own: RankKV) -> None:
        self.own = own

    def on_report(self, report: TransferReport) -> None:
        """Rank 0's RankKV calls this on its I/O thread as each of its transfers ends."""
        with self._lock:
            self._reports.append(report)

    def send(self, transfers: tuple[Transfer, ...]) -> None:
        """Start transfers on every rank now, with no step."""
        if not transfers:
            return
        self.executor.send_transfers(transfers)
        self.after_forward(transfers)

    def after_forward(self, transfers: tuple[Transfer, ...]) -> None:
        """Start rank 0's part of a step's transfers (its forward wrote the saved blocks)."""
        if self.own is None:
            raise RuntimeError("rank 0's KV transfers are not built")
        for t in transfers:
            self.own.start(t)

    def poll(self) -> list[TransferReport]:
        """Every rank's reports that arrived, rank 0's first, without waiting."""
        with self._lock:
            mine, self._reports = self._reports, []
        return mine + self.executor.poll_reports()

    def close(self) -> None:
        own, self.own = self.own, None
        if own is not None:
            own.close()
