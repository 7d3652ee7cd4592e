"""A storage node's memory segment and the transport handler that serves it.

The segment is one preallocated uint8 buffer; the master decides every offset, so the node
only checks bounds. Writes land straight in the segment (the handler names the landing
slice before the payload is received) and reads send a view of it: no copy on either side.
A request is checked in full before any byte of its payload is received: its header must
decode, a READ carries no payload, a WRITE's payload is exactly its length and in bounds.
"""

from __future__ import annotations

import numpy as np

from pdserve.connector.transport import FrameRejected
from pdserve.connector.kvstore.node_protocol import READ, WRITE, NodeOp


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
    """`RequestHandler` for NodeOp requests against one segment."""

    def __init__(self, segment: Segment):
        self._segment = segment

    def _target(self, header: bytes) -> tuple[NodeOp, memoryview]:
        try:
            op = NodeOp.decode(header)
            return op, self._segment.slice(op.offset, op.length)
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
        op, target = self._target(header)
        if op.op == READ:
            return b"", target
        if payload.obj is not target.obj:  # payload_buffer always lands a WRITE in place
            raise FrameRejected("write did not land in the segment")
        return b"", b""
