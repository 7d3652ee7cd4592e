"""One tensor-parallel rank's transfers of its own heads' objects, and rank 0's tally of every
rank's reports (docs/parallelism.md, "Per-rank transfers", steps 3 and 4).

Rank 0's connector decides what moves (the saves of blocks that became full, the loads that
start) and sends each rank a `Transfer` (typed, picklable: it travels in the step's message).
Every rank, rank 0 included, runs it with its own `RankTransfers` over its own store client:
a save encodes this rank's heads of each block (their MACs) and puts them; a load fetches
this rank's heads' objects, checks each MAC and installs the leading blocks whose every head
object came and verified. Each finished transfer gives one `TransferReport`, which a worker
sends back to rank 0; `Completions` there (common/engine/rank_kv_tally.py) books a transfer finished once every rank
reported it, with the block count the smallest any rank reached (a load recomputes from the
first block some rank missed; a save is over, whatever stored, once no rank still reads the
blocks). The messages themselves are in common/engine/kv_rank_messages.py, so the step's
message can carry them.

Why a save is encoded on the caller's thread at `start`: the step that filled the blocks has
just run, and the caller (the worker's step loop) is the only writer of its caches, so the
bytes are copied before any later step could touch them; the puts then run on the I/O
thread. A load installs on the I/O thread's worker: no step reads those blocks until rank 0
booked the load finished, which waits for this rank's report.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Callable, Optional

from pdserve.common.engine.kv_rank_messages import Transfer, TransferReport
from pdserve.connector.codec import BlockCodecError
from pdserve.connector.head_objects import RankHeads
from pdserve.connector.io_thread import IOThread
from pdserve.connector.store import BlockStore, put_stored

log = logging.getLogger(__name__)


class RankTransfers:
    """One rank's side: `start` a transfer, `poll` the reports of those that finished."""

    def __init__(self, heads: RankHeads, store: BlockStore, io: IOThread, rank: int,
                 lease_s: float, load_timeout_s: float, max_inflight: int = 8,
                 on_report: Optional[Callable[[TransferReport], None]] = None):
        """`on_report`: called with each report on the I/O thread as its transfer ends,
        instead of queueing it for `poll`. A worker sends its reports that way: its step
        loop blocks between steps, and rank 0 may be waiting for exactly that report (a
        producer's last output waits for its save) with no step to send."""
        self.heads, self.store, self.io, self.rank = heads, store, io, rank
        self.lease_s, self.load_timeout_s, self.max_inflight = (lease_s, load_timeout_s,
                                                                 max_inflight)
        self.on_report = on_report
        self._lock = threading.Lock()
        self._done: list[TransferReport] = []
        self._pending: set[concurrent.futures.Future] = set()

    def start(self, t: Transfer) -> None:
        if t.kind == "save":
            objs = [o for b in t.blocks for o in self.heads.encode(b.key, b.block_id)]
            fut = self.io.submit(self._save(t, objs))
        else:
            fut = self.io.submit(self._load(t))
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._forget)

    def _forget(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def poll(self) -> list[TransferReport]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def _report(self, t: Transfer, blocks: int) -> None:
        report = TransferReport(t.request_id, t.kind, self.rank, blocks, t.seq)
        if self.on_report is not None:
            self.on_report(report)
            return
        with self._lock:
            self._done.append(report)

    async def _save(self, t: Transfer, objs) -> None:
        stored = 0
        try:
            try:
                results = await self.store.put_many(objs, lease_s=self.lease_s)
            except Exception as exc:  # noqa: BLE001 - the store is down: nothing stored
                results = [exc] * len(objs)
            ok = [not isinstance(r, BaseException) and put_stored(r) for r in results]
            h = self.heads.num_heads
            while stored < len(t.blocks) and all(ok[stored * h:(stored + 1) * h]):
                stored += 1
        finally:
            self._report(t, stored)

    async def _load(self, t: Transfer) -> None:
        loaded = 0
        try:
            h, nbytes = self.heads.num_heads, self.heads.objects.head_codec.nbytes
            keys = [k for b in t.blocks for k in self.heads.keys(b.key)]
            bufs = [bytearray(nbytes) for _ in keys]
            fetch = self.store.get_many_into(keys, [memoryview(b) for b in bufs],
                                             self.max_inflight)
            try:
                results = await asyncio.wait_for(fetch, self.load_timeout_s)
            except Exception:  # noqa: BLE001 - timeout or store down: recompute
                results = [None] * len(keys)
            loaded = await self.io.offload(self._install, t, bufs, results, h)
        finally:
            self._report(t, loaded)

    def _install(self, t: Transfer, bufs, results, h: int) -> int:
        """Install leading blocks whose every head object came and verifies; how many."""
        for j, b in enumerate(t.blocks):
            got = results[j * h:(j + 1) * h]
            if any(not isinstance(n, int) or n != len(bufs[0]) for n in got):
                return j
            try:
                self.heads.install(b.key, b.block_id,
                                   [memoryview(x) for x in bufs[j * h:(j + 1) * h]])
            except BlockCodecError as exc:
                log.warning("%s", exc)
                return j
        return len(t.blocks)
