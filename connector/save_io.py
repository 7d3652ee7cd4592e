"""The producer's puts, a mixin of StoreKVConnector (they run on its I/O thread's loop).

A step's objects of one layer segment go to the store in one `put_many` (two master round
trips for all of them, each node's writes pipelined on one connection: the store client's
batch_put.py). Each object's header, with its block MAC, is written on the I/O loop just
before the object is sent (`SharedSeals` without a worker), while the node receives the
objects before it. `SharedSeals` can also let the I/O worker seal ahead (its NH releases the
GIL) with the loop sealing whatever the worker has not reached; on the 2-core Zen 3 of
2026-12-02 that was slower at one SmolLM2 block (tcp+cap+mac / socket 0.40-0.58 against
0.77-1.35 inline, `pdserve bench transport --seal shared|inline`, two sittings): a third busy
thread on two cores costs more than it overlaps. Hosts with spare cores may differ; not
measured.

The host class provides `store`, `segments`, `config`, `io`, `stats`, `_lock`, `_saving`,
`_saved`, `_freed`, `_budget_used` and `_note_failure` (store_connector.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Callable, Optional

from pdserve.connector.codec import HEADER_SIZE, BlockCodec
from pdserve.connector.staging import Block, StagedStep, staged_blocks
from pdserve.connector.store import put_stored


class _Shared:
    """What SharedSeals' slices share: each object's state under one lock."""
    PENDING, CLAIMED, SEALED = 0, 1, 2

    def __init__(self, n: int):
        self.cond = threading.Condition()
        self.state = [self.PENDING] * n
        self.stop = False  # drain(): the worker claims nothing more
        self.worker: Optional[asyncio.Future] = None


class SharedSeals(Sequence):
    """`ready` for put_many, sealing (codec.header) each object exactly once by whichever
    gets to it first: one worker call per put (`start`: the I/O worker, started by the first
    `ready[i]`) seals the objects in order, while the loop, asked for `ready[i]`, seals object
    i itself if the worker has not claimed it yet, or waits (blocking, at most one MAC) for the
    worker to finish it; then `ready[i]` is a done future, awaitable by every replica's write.
    The MAC's native calls release the GIL, so the worker seals the next objects while the
    loop sends this one, with no hand-off per object. Without `start` the loop seals each
    object just before its send (nothing ahead of need). A slice (put_many's batches) shares
    the state of the whole. `drain()` before the buffers are reused."""

    def __init__(self, codec: BlockCodec, objs: list[tuple[bytes, memoryview]],
                 start: Optional[Callable[..., asyncio.Future]],
                 _shared: Optional[_Shared] = None, _at: Optional[range] = None):
        self._codec, self._objs, self._start = codec, objs, start
        self._shared = _Shared(len(objs)) if _shared is None else _shared
        self._at = range(len(objs)) if _at is None else _at
        self._done = asyncio.get_running_loop().create_future()
        self._done.set_result(None)

    def __len__(self) -> int:
        return len(self._at)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return SharedSeals(self._codec, self._objs, self._start, self._shared, self._at[i])
        sh = self._shared
        if sh.worker is None and not sh.stop and self._start is not None:
            sh.worker = self._start(self._work)
        if self._claim(self._at[i], wait=True):
            self._seal(self._at[i])
        return self._done

    def _claim(self, j: int, wait: bool) -> bool:
        """Whether the caller is to seal object j (it was pending); with `wait`, an object
        the other side is sealing is waited for."""
        sh = self._shared
        with sh.cond:
            if sh.state[j] == _Shared.PENDING:
                sh.state[j] = _Shared.CLAIMED
                return True
            while wait and sh.state[j] != _Shared.SEALED:
                sh.cond.wait()
            return False

    def _seal(self, j: int) -> None:
        key, view = self._objs[j]
        try:
            view[:HEADER_SIZE] = self._codec.header(key, view[HEADER_SIZE:])
        finally:  # a failed seal leaves a blank header: the node stores it, readers refuse it
            with self._shared.cond:
                self._shared.state[j] = _Shared.SEALED
                self._shared.cond.notify_all()

    def _work(self) -> None:
        for j in range(len(self._objs)):
            if self._shared.stop:
                return
            if self._claim(j, wait=False):
                self._seal(j)

    async def drain(self) -> None:
        """Stop the worker claiming objects and wait for what it is sealing."""
        self._shared.stop = True
        if self._shared.worker is not None:
            await asyncio.gather(self._shared.worker, return_exceptions=True)


class SaveIO:
    def _submit_save(self, step: StagedStep, done: list[str],
                     earlier: Optional[list[concurrent.futures.Future]] = None,
                     reserved: int = 0) -> None:
        """Put a staged step's blocks on the I/O thread (see _put_blocks for `earlier`);
        `done`: one count taken in _saving each, released once the puts are over, as are
        `reserved` bytes of the save budget (decode's saves)."""
        blocks = staged_blocks(self.segments, [key for _, key, _ in step.staged], step.bufs)
        self.io.submit(self._put_blocks(blocks, done, earlier, reserved))

    async def _put_blocks(self, blocks: list[Block], done: list[str],
                          earlier: Optional[list[concurrent.futures.Future]] = None,
                          reserved: int = 0) -> None:
        """Put blocks (key, one encoded view per segment), then mark `done` (one entry per
        count taken in _saving) finished and give `reserved` budget bytes back, whatever
        happened. Every earlier segment first (or
        `earlier`: their puts, started during the forward, one future per segment), then the
        last segment, under the block's key, of each block whose earlier segments all stored."""
        last = self.segments.count - 1
        try:
            ok = [True] * len(blocks)
            if earlier is None:
                earlier = [self._put_objects(s, [(self.segments.key(k, s), v[s])
                                                 for k, v in blocks]) for s in range(last)]
                results = await asyncio.gather(*earlier)
            else:
                results = [await asyncio.wrap_future(f) for f in earlier]
            for seg_ok in results:
                ok = [a and b for a, b in zip(ok, seg_ok)]
            todo = [(k, v[last]) for (k, v), good in zip(blocks, ok) if good]
            stored = await self._put_objects(last, todo)
            self.stats.blocks_saved += sum(stored)
            self.stats.save_failures += len(blocks) - sum(stored)
        finally:
            with self._lock:
                self._saves_done(done)
                self._budget_used -= reserved

    def _saves_done(self, rids: list[str]) -> None:
        """(Under _lock.) One save in flight fewer for each entry; a request with none left
        is saved."""
        for rid in rids:
            self._saving[rid] -= 1
            if self._saving[rid] == 0:
                del self._saving[rid]
                self._freed.discard(rid)
                self._saved.add(rid)

    async def _put_objects(self, s: int, objs: list[tuple[bytes, memoryview]]) -> list[bool]:
        """Put objects of segment s (store key, encoded view, header still blank) in one
        put_many, each header sealed on the loop just before its send; which stored."""
        if not objs:
            return []
        t0, codec = time.perf_counter(), self.segments.codecs[s]
        sealed = SharedSeals(codec, objs, None)  # the loop seals: faster here, see the module
        try:
            results = await self.store.put_many(objs, lease_s=self.config.lease_s,
                                                ready=sealed)
        except Exception as exc:  # noqa: BLE001 - the store is down: every put failed
            results = [exc] * len(objs)
        finally:
            await sealed.drain()  # the staging buffers are released after this returns
        ok = [self._stored(r) for r in results]
        self.stats.bytes_saved += sum(ok) * codec.nbytes
        self.stats.save_seconds += time.perf_counter() - t0
        return ok

    def _stored(self, result) -> bool:
        """A put's result (a status, or the exception that failed it), failures noted."""
        if isinstance(result, BaseException):
            self._note_failure("save:" + type(result).__name__)
            return False
        if not put_stored(result):
            self._note_failure("save:" + str(getattr(result, "value", result)))
        return put_stored(result)
