"""A storage node's memory segment and the transport handler that serves it.

The segment is one preallocated uint8 buffer; the master decides every offset, so the node
only checks bounds. Writes land straight in the segment (the handler names the landing
slice before the payload is received) and reads send a view of it: no copy on either side.
A request is checked in full before any byte of its payload is received: its header must
decode, its capability must grant exactly this op and range on this node (when the store runs
with a secret), a READ carries no payload, a WRITE's payload is its length and in bounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from pdserve.connector.kvstore.auth import AuthError, check_capability
from pdserve.connector.kvstore.node_protocol import READ, NodeOp
from pdserve.connector.transport import FrameRejected


@dataclass(frozen=True, repr=False)
class GrantCheck:
    """Checks a request's capability against this node's id and clock (no master round trip)."""
    key: bytes  # the grant key derived from the store secret
    node_id: str
    skew_s: float = 2.0  # tolerated clock difference with the master
    clock: Callable[[], float] = field(default=time.time)

    def __call__(self, op: NodeOp) -> None:
        check_capability(self.key, op.op, self.node_id, op.offset, op.length, op.capability,
                         self.clock(), self.skew_s)


class Segment:
    def __init__(self, capacity: int):
        # np.zeros maps pages lazily: a large segment costs memory only as it fills.
        self._buf = np.zeros(capacity, dtype=np.uint8)
        self.view = memoryview(self._buf)
        self.capacity = capacity

    def slice(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.capacity:
            raise ValueError(f"range {offset}+{length} is outside the segment")
        return self.view[offset:offset + length]


class SegmentHandler:
    """`RequestHandler` for NodeOp requests against one segment. `grants` is None only for a
    store run without a secret (every request is then served); start_node sets it once, after
    the listener knows its address and before the node registers (no grant exists before)."""

    def __init__(self, segment: Segment, grants: Optional[GrantCheck] = None):
        self._segment = segment
        self.grants = grants

    def _target(self, header: bytes) -> tuple[NodeOp, memoryview]:
        try:
            op = NodeOp.decode(header)
            if self.grants is not None:
                self.grants(op)
            return op, self._segment.slice(op.offset, op.length)
        except AuthError as exc:
            raise FrameRejected(f"refused: {exc}") from None
        except ValueError as exc:
            raise FrameRejected(str(exc)) from None

    def payload_buffer(self, header: bytes, nbytes: int) -> memoryview | None:
        op, target = self._target(header)
        if op.op == READ:
            if nbytes:
                raise FrameRejected("a READ carries no payload")
            return None
        if nbytes != op.length:
            raise FrameRejected(f"write of {nbytes} bytes, header says {op.length}")
        return target

    async def handle(self, header: bytes, payload: memoryview):
        return self.serve(header, payload)

    def serve(self, header: bytes, payload: memoryview):
        """The request served without awaiting (a thread-per-connection listener calls this)."""
        op = NodeOp.decode(header)
        if op.op == READ:
            return b"", self._target(header)[1]
        # payload_buffer checked this WRITE (capability included) and landed it in place
        if len(payload) and payload.obj is not self._segment.view.obj:
            raise FrameRejected("write did not land in the segment")
        return b"", b""
