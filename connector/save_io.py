"""The producer's puts, a mixin of StoreKVConnector (they run on its I/O thread's loop).

A step's objects of one layer segment go to the store in one `put_many` (two master round
trips for all of them, each node's writes pipelined on one connection: the store client's
batch_put.py). Each object's header, with its block MAC, is written on the loop just before
the object is sent (`InlineSeals`), while the node receives the objects before it: the MAC
(NH-Poly1305, 76-91 us for a 0.7 MB block on a 2-core Zen 3, connector/codec.py) costs about
what a hand-off to a worker thread does, and on two cores a worker has no core of its own:
letting the I/O worker seal ahead beside the loop (NH releases the GIL; commit 3a6c808) was
slower there, 0.40-0.58 of a raw socket at one SmolLM2 block against 0.77-1.35 inline.

The host class provides `store`, `segments`, `config`, `io`, `stats`, `_lock`, `_saving`,
`_saved`, `_freed`, `_budget_used` and `_note_failure` (store_connector.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from typing import Optional

from pdserve.connector.codec import HEADER_SIZE, BlockCodec
from pdserve.connector.staging import Block, StagedStep, staged_blocks
from pdserve.connector.store import put_stored



class InlineSeals(Sequence):
    """`ready` for put_many: `ready[i]` writes object i's header (its MAC, codec.header) on the
    caller's thread the first time it is asked for, and is then a done future (awaitable by
    every replica's write). So each MAC runs just before its object is sent, while the node
    receives the objects before it. A slice (put_many splits a call into batches) shares what
    is sealed with the whole."""

    def __init__(self, codec: BlockCodec, objs: list[tuple[bytes, memoryview]],
                 _sealed: Optional[list[bool]] = None, _at: Optional[range] = None):
        self._codec, self._objs = codec, objs
        self._sealed = [False] * len(objs) if _sealed is None else _sealed
        self._at = range(len(objs)) if _at is None else _at
        self._done = asyncio.get_running_loop().create_future()
        self._done.set_result(None)

    def __len__(self) -> int:
        return len(self._at)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return InlineSeals(self._codec, self._objs, self._sealed, self._at[i])
        j = self._at[i]
        if not self._sealed[j]:
            key, view = self._objs[j]
            view[:HEADER_SIZE] = self._codec.header(key, view[HEADER_SIZE:])
            self._sealed[j] = True
        return self._done


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
        put_many, each header sealed just before its object goes out; which stored."""
        if not objs:
            return []
        t0, codec = time.perf_counter(), self.segments.codecs[s]
        try:
            results = await self.store.put_many(objs, lease_s=self.config.lease_s,
                                                ready=InlineSeals(codec, objs))
        except Exception as exc:  # noqa: BLE001 - the store is down: every put failed
            results = [exc] * len(objs)
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
