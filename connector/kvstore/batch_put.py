"""Many puts as one: BatchPutStart -> the node writes, pipelined -> BatchPutEnd.

Why: a put of one object costs two master round trips and a node round trip whatever its
size, so a step's blocks put one by one were bound by round trips, not bytes (0.7 MB SmolLM2
blocks: ~80 MB/s with 8 puts in flight). Batched, a step costs two master round trips, and
each node's writes go out back to back on one connection (connector/transport/pipeline.py),
the next frame sent while the node still acks the one before.

Same guarantees as KVStoreClient.put, per object: the master validates, places and grants
each entry as a PutStart (first writer wins; an entry's refusal is its own status); an object
is ended only once every replica acked its bytes; one whose write failed, or that was still
unacked at the deadline (put_timeout_s from the BatchPutStart), is revoked, so its space is
freed at once and no reader ever sees it; a caller that cancels gets its started objects
revoked in the background. `ready[i]` (optional) is awaited just before object i's first
byte goes out: the caller may still be writing its header (the block MAC) until then.

EXISTS means readable. The master answers EXISTS for a key stored and complete, and WRITING
for one another put still writes (first writer wins). A WRITING entry is asked again
(BatchPutStart) until that object is complete, then reported EXISTS; if the object goes away
first (its writer revoked it: a failed or timed-out write), the master grants the key to
this put, which writes it itself. Still WRITING after `settle_s` (within the put's
deadline): UNSETTLED, so a stuck writer costs the put that long, not its whole deadline. A
producer told EXISTS tells its consumers to load the key; when EXISTS covered both, a burst
of requests with one prompt had decode instances miss blocks another request's save had not
finished, and recompute them. A key stored long before (a shared system prompt's blocks)
costs no second call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, Sequence

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.connector.kvstore import convert
from pdserve.connector.kvstore.conn_pool import ConnectionPool
from pdserve.connector.kvstore.errors import KVStoreUnavailable
from pdserve.connector.kvstore.node_protocol import WRITE, NodeOp
from pdserve.connector.kvstore.records import PutStatus, Replica
from pdserve.connector.transport import RemoteError, TransportError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MasterCalls:
    """The client's master calls a batch put needs: `call(rpc, request)` with the lookup
    deadline and error mapping, the stub, and where background revokes are kept."""
    call: Callable
    stub: object  # KVStoreMasterStub
    revokes: set = field(hash=False, compare=False)


@dataclass
class _Progress:
    """Per object: replica writes still unacked, and the first error of any of them."""
    pending: list[int]
    errors: dict[int, Exception] = field(default_factory=dict)

    def acked(self, i: int, error: Optional[Exception]) -> None:
        self.pending[i] -= 1
        if error is not None:
            self.errors.setdefault(i, error)

    def good(self, i: int) -> bool:
        return self.pending[i] == 0 and i not in self.errors


@dataclass(frozen=True)
class _Batch:
    """One put_batch call's objects and limits: what a first start and a takeover share."""
    pool: ConnectionPool
    skeys: list[bytes]
    views: list[memoryview]
    lease_s: float
    replica_num: int
    ready: Optional[Sequence[Awaitable]]
    deadline: float  # time.monotonic() by which every write is acked, or revoked
    timeout_s: float


async def put_batch(master: MasterCalls, pool: ConnectionPool, skeys: list[bytes],
                    views: list[memoryview], lease_s: float, replica_num: int,
                    timeout_s: float, ready: Optional[Sequence[Awaitable]] = None, *,
                    settle_s: float) -> list:
    """Put views[i] under store key skeys[i]; per object a PutStatus or KVStoreUnavailable.
    An unreachable master at BatchPutStart raises KVStoreUnavailable (nothing started).
    `settle_s`: the longest a WRITING entry waits for the other writer (settle_writing)."""
    batch = _Batch(pool, skeys, views, lease_s, replica_num, ready,
                   time.monotonic() + timeout_s, timeout_s)
    results: list = [PutStatus.WRITING] * len(skeys)
    await _start_and_write(master, batch, range(len(skeys)), results)
    await settle_writing(master, batch, results, settle_s)
    return results


async def _start_and_write(master: MasterCalls, batch: _Batch, which: Sequence[int],
                           results: list) -> None:
    """BatchPutStart for objects `which`; each answer becomes results[i], and the objects
    granted (OK) are written, then ended or revoked (results[i]: their outcome). Raises
    KVStoreUnavailable, with nothing started, if the master is unreachable."""
    started = convert.put_starts_from_pb(await master.call(
        master.stub.BatchPutStart, pb.BatchPutStartRequest(entries=[
            pb.PutStartRequest(key=batch.skeys[i], size=len(batch.views[i]),
                               lease_s=batch.lease_s, replica_num=batch.replica_num)
            for i in which])), len(which))
    grants = {}
    for i, s in zip(which, started):
        results[i] = s.status
        if s.status is PutStatus.OK:
            grants[i] = s
    if grants:
        await _put_mine(master, batch, grants, results)


async def _put_mine(master: MasterCalls, batch: _Batch, grants: dict, results: list) -> None:
    """The writes, then the ends or revokes, of the objects granted (index -> PutStart);
    their results set in place."""
    mine = list(grants)
    progress = _Progress([len(grants[i].replicas) if i in grants else 0
                          for i in range(len(batch.skeys))])
    skeys = batch.skeys
    try:
        await _write_all(batch, grants, progress)
    except asyncio.CancelledError:  # the caller gave up: revoke without holding it
        _revoke_later(master, [skeys[i] for i in mine])
        raise
    good = [i for i in mine if progress.good(i)]
    bad = [i for i in mine if not progress.good(i)]
    ended, _ = await asyncio.gather(_end(master, [skeys[i] for i in good]),
                                    _revoke(master, [skeys[i] for i in bad]))
    for i, ok in zip(good, ended):
        results[i] = PutStatus.OK if ok else PutStatus.REVOKED
    for i in bad:
        results[i] = progress.errors.get(i) or KVStoreUnavailable(
            f"put timed out after {batch.timeout_s} s; revoked")


async def settle_writing(master: MasterCalls, batch: _Batch, results: list,
                         settle_s: float) -> None:
    """Settle every WRITING entry (another put was writing its key). It is asked again with
    BatchPutStart (1 ms doubling to 32 ms) for at most `settle_s` from now, never past the
    put's deadline: EXISTS once the other object is complete; if that object is gone (its
    writer revoked it, or it was evicted), the master grants the key to this put, which
    writes it itself (a takeover: the entry takes its own write's outcome) instead of
    waiting out `settle_s` for nothing; still WRITING at the end: UNSETTLED. A key this
    batch holds twice settles once, at its first entry; the others take EXISTS if that one
    is stored, else UNSETTLED. Afterwards no entry is WRITING."""
    until = min(batch.deadline, time.monotonic() + settle_s)
    first: dict[bytes, int] = {}
    for i, k in enumerate(batch.skeys):
        first.setdefault(k, i)
    waiting = [i for i, r in enumerate(results)
               if r is PutStatus.WRITING and first[batch.skeys[i]] == i]
    pause = 0.001
    while waiting and time.monotonic() + pause <= until:
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.032)
        try:
            await _start_and_write(master, batch, waiting, results)
        except KVStoreUnavailable:  # asked again after the pause, until the deadline
            continue
        waiting = [i for i in waiting if results[i] is PutStatus.WRITING]
    for i in waiting:
        results[i] = PutStatus.UNSETTLED
    for i, r in enumerate(results):
        if r is PutStatus.WRITING:
            own = results[first[batch.skeys[i]]]
            results[i] = (PutStatus.EXISTS if own is PutStatus.OK or own is PutStatus.EXISTS
                          else PutStatus.UNSETTLED)


async def _write_all(batch: _Batch, grants: dict, progress: _Progress) -> None:
    """Every replica write of the granted objects, one pipelined connection per node, until
    all are acked or the deadline passes (then the unacked ones are simply not good)."""
    per_node: dict[str, list[tuple[int, Replica]]] = {}
    for i, started in grants.items():
        for r in started.replicas:
            per_node.setdefault(r.address, []).append((i, r))
    tasks = [asyncio.ensure_future(_write_node(batch.pool, addr, writes, batch.views,
                                               progress, batch.ready))
             for addr, writes in per_node.items()]
    try:
        await asyncio.wait(tasks, timeout=max(batch.deadline - time.monotonic(), 0.001))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _write_node(pool: ConnectionPool, address: str, writes: list[tuple[int, Replica]],
                      views, progress: _Progress, ready) -> None:
    requests = [(NodeOp(WRITE, r.offset, len(views[i]), r.capability).encode(), views[i])
                for i, r in writes]

    async def before_send(j: int) -> None:
        if ready is not None:
            await ready[writes[j][0]]

    answered: set[int] = set()

    def on_reply(j: int, answer) -> None:
        answered.add(j)
        error = None if not isinstance(answer, RemoteError) else KVStoreUnavailable(
            f"write to node {writes[j][1].node_id} refused: {answer}")
        progress.acked(writes[j][0], error)

    try:
        async with pool.connection(address) as conn:
            await conn.pipeline(requests, before_send, on_reply)
    except Exception as exc:  # noqa: BLE001 - broken connection, or a `ready` that failed
        why = (f"write to node {writes[0][1].node_id} failed: {exc}"
               if isinstance(exc, (TransportError, RemoteError))
               else f"object not ready: {type(exc).__name__}: {exc}")
        for j, (i, _) in enumerate(writes):  # the writes not acked by now did not happen
            if j not in answered:
                progress.errors.setdefault(i, KVStoreUnavailable(why))


async def _end(master: MasterCalls, skeys: list[bytes]) -> list[bool]:
    if not skeys:
        return []
    try:
        resp = await master.call(master.stub.BatchPutEnd, pb.BatchPutEndRequest(keys=skeys))
    except KVStoreUnavailable as exc:  # never ended: the master's put timeout reclaims them
        log.warning("BatchPutEnd failed (%s); %d objects are lost", exc, len(skeys))
        return [False] * len(skeys)
    if len(resp.ok) != len(skeys):
        return [False] * len(skeys)
    return list(resp.ok)


async def _revoke(master: MasterCalls, skeys: list[bytes]) -> None:
    if not skeys:
        return
    try:  # best effort: if the master is gone too, its put timeout reclaims the space
        await master.call(master.stub.BatchPutRevoke, pb.BatchPutRevokeRequest(keys=skeys))
    except KVStoreUnavailable as exc:
        log.warning("BatchPutRevoke failed (%s); the master's put timeout will reclaim it",
                    exc)


def _revoke_later(master: MasterCalls, skeys: list[bytes]) -> None:
    task = asyncio.get_running_loop().create_task(_revoke(master, skeys))
    master.revokes.add(task)
    task.add_done_callback(master.revokes.discard)
