"""A storage node's memory segment and the transport handler that serves it.

The segment is one preallocated uint8 buffer; the master decides every offset, so the node
only checks bounds. Writes land straight in the segment (the handler names the landing
slice before the payload is received) and reads send a view of it: no copy on either side.
"""

from __future__ import annotations

import numpy as np

from pdserve.services.kvstore.node_protocol import READ, WRITE, NodeOp


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

    def payload_buffer(self, header: bytes, nbytes: int) -> memoryview | None:
        try:
            op = NodeOp.decode(header)
        except ValueError:
            return None  # handle() reports it
        if op.op == WRITE and op.length == nbytes:
            try:
                return self._segment.slice(op.offset, op.length)
            except ValueError:
                return None
        return None

    async def handle(self, header: bytes, payload: memoryview):
        op = NodeOp.decode(header)
        target = self._segment.slice(op.offset, op.length)
        if op.op == READ:
            return b"", target
        if len(payload) != op.length:
            raise ValueError(f"write of {len(payload)} bytes, header says {op.length}")
        if payload.obj is not target.obj:  # not landed in place (bounds refused or size off)
            target[:] = payload
        return b"", b""
