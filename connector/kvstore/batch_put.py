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
for one another put still writes (first writer wins). A WRITING entry is reported EXISTS only
once that object is complete (polled with BatchExists for up to `settle_s`, within the put's
deadline), else UNSETTLED: a writer that is stuck, or an object revoked or evicted meanwhile,
costs the put that long, not its whole deadline. A producer told EXISTS tells its consumers
to load the key; when EXISTS covered both, a burst of requests with one prompt had decode
instances miss blocks another request's save had not finished, and recompute them. A key
stored long before (a shared system prompt's blocks) costs no poll.
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


async def put_batch(master: MasterCalls, pool: ConnectionPool, skeys: list[bytes],
                    views: list[memoryview], lease_s: float, replica_num: int,
                    timeout_s: float, ready: Optional[Sequence[Awaitable]] = None, *,
                    settle_s: float) -> list:
    """Put views[i] under store key skeys[i]; per object a PutStatus or KVStoreUnavailable.
    An unreachable master at BatchPutStart raises KVStoreUnavailable (nothing started).
    `settle_s`: the longest a WRITING entry waits for the other writer (settle_writing)."""
    deadline = time.monotonic() + timeout_s
    started = convert.put_starts_from_pb(await master.call(
        master.stub.BatchPutStart, pb.BatchPutStartRequest(entries=[
            pb.PutStartRequest(key=k, size=len(v), lease_s=lease_s, replica_num=replica_num)
            for k, v in zip(skeys, views)])), len(skeys))
    mine = [i for i, s in enumerate(started) if s.status is PutStatus.OK]
    results: list = [s.status for s in started]
    if mine:
        await _put_mine(master, pool, skeys, views, started, mine, results, ready, deadline,
                        timeout_s)
    await settle_writing(master, skeys, mine, results, deadline, settle_s)
    return results


async def _put_mine(master, pool, skeys, views, started, mine, results, ready, deadline,
                    timeout_s) -> None:
    """The writes, then the ends or revokes, of the entries this batch started; their
    results set in place."""
    progress = _Progress([len(started[i].replicas) for i in range(len(skeys))])
    try:
        await _write_all(pool, started, views, mine, progress, ready, deadline)
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
            f"put timed out after {timeout_s} s; revoked")


async def settle_writing(master: MasterCalls, skeys: list[bytes], mine: list[int],
                         results: list, deadline: float, settle_s: float) -> None:
    """Each WRITING entry becomes EXISTS once its object is complete, else UNSETTLED. A key
    this batch wrote itself takes that entry's outcome; the others are polled (BatchExists,
    1 ms doubling to 32 ms) until complete, for at most `settle_s` from now and never past
    `deadline` (the put's). Afterwards no entry is WRITING."""
    deadline = min(deadline, time.monotonic() + settle_s)
    own = {skeys[i]: results[i] for i in mine}
    waiting = []
    for i, r in enumerate(results):
        if r is not PutStatus.WRITING:
            continue
        if skeys[i] in own:
            results[i] = PutStatus.EXISTS if own[skeys[i]] is PutStatus.OK else (
                PutStatus.UNSETTLED)
        else:
            waiting.append(i)
    pause = 0.001
    while waiting:
        try:
            resp = await master.call(master.stub.BatchExists, pb.BatchExistsRequest(
                keys=[skeys[i] for i in waiting]))
            exists = list(resp.exists)
        except KVStoreUnavailable:  # asked again after the pause, until the deadline
            exists = []
        if len(exists) == len(waiting):
            for i, e in zip(waiting, exists):
                if e:
                    results[i] = PutStatus.EXISTS
            waiting = [i for i, e in zip(waiting, exists) if not e]
        if not waiting or time.monotonic() + pause > deadline:
            break
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.032)
    for i in waiting:
        results[i] = PutStatus.UNSETTLED


async def _write_all(pool, started, views, mine, progress: _Progress, ready, deadline) -> None:
    """Every replica write of the started objects, one pipelined connection per node, until
    all are acked or the deadline passes (then the unacked ones are simply not good)."""
    per_node: dict[str, list[tuple[int, Replica]]] = {}
    for i in mine:
        for r in started[i].replicas:
            per_node.setdefault(r.address, []).append((i, r))
    tasks = [asyncio.ensure_future(_write_node(pool, addr, writes, views, progress, ready))
             for addr, writes in per_node.items()]
    try:
        await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0.001))
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
