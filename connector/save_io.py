"""The producer's puts, a mixin of StoreKVConnector (they run on its I/O thread's loop).

A step's objects of one layer segment go to the store in one `put_many` (two master round
trips for all of them, each node's writes pipelined on one connection: the store client's
batch_put.py). Their headers, with the block MACs, are written on the I/O worker in chunks
that grow 1, 2, 4, ... objects up to SEAL_CHUNK_BYTES (`seal_chunks`): the first object is
ready soon, the later ones share one hand-off to the worker (a wake-up costs ~70-90 us on a
loaded 2-core VM, more than the GMAC of a 0.7 MB block at 12 GB/s), and each chunk's MACs
are computed while the objects before it are on the wire.

The host class provides `store`, `segments`, `config`, `io`, `stats`, `_lock`, `_saving`,
`_saved`, `_freed`, `_budget_used` and `_note_failure` (store_connector.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Optional

from pdserve.connector.codec import HEADER_SIZE, BlockCodec
from pdserve.connector.io_thread import IOThread
from pdserve.connector.staging import Block, StagedStep, staged_blocks
from pdserve.connector.store import put_stored

# The most bytes of objects one hand-off to the worker seals. Bigger chunks, fewer hand-offs:
# pipelined 0.7 MB blocks with their MACs ran 2.2 GB/s at 1 MiB (a hand-off per block),
# 2.7-3.1 at 4 MiB and 3.1-3.3 at 16 MiB (2-core Xeon, 3 interleaved runs, 2026-12-02).
SEAL_CHUNK_BYTES = 16 << 20


def _seal(codec: BlockCodec, objs: list[tuple[bytes, memoryview]]) -> None:
    """(On the I/O worker.) Write each object's header, its MAC over its payload."""
    for key, view in objs:
        view[:HEADER_SIZE] = codec.header(key, view[HEADER_SIZE:])


def seal_chunks(io: IOThread, codec: BlockCodec,
                objs: list[tuple[bytes, memoryview]]) -> list[asyncio.Future]:
    """Start writing the objects' headers (codec.header) on the I/O worker, in order, in
    growing chunks; per object, the future of its chunk (awaited before its bytes are sent).
    The objects are of one size (one layer segment's)."""
    futures: list[asyncio.Future] = []
    size = len(objs[0][1]) if objs else 1
    at, n, most = 0, 1, max(1, SEAL_CHUNK_BYTES // size)
    while at < len(objs):
        chunk = objs[at:at + n]
        fut = asyncio.ensure_future(io.offload(_seal, codec, chunk))
        futures += [fut] * len(chunk)
        at, n = at + len(chunk), min(2 * n, most)
    return futures


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
        put_many, their headers sealed on the I/O worker meanwhile; which stored."""
        if not objs:
            return []
        t0, codec = time.perf_counter(), self.segments.codecs[s]
        sealed = seal_chunks(self.io, codec, objs)
        try:
            results = await self.store.put_many(objs, lease_s=self.config.lease_s,
                                                ready=sealed)
        except Exception as exc:  # noqa: BLE001 - the store is down: every put failed
            results = [exc] * len(objs)
        finally:  # no worker still writes a header once the caller has its buffers back
            await asyncio.gather(*set(sealed), return_exceptions=True)
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
