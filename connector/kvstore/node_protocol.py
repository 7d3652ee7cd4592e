"""The storage node's transport requests: read or write `length` bytes at `offset`."""

from __future__ import annotations

import struct
from dataclasses import dataclass

_HEADER = struct.Struct("!cQQ")
READ = b"R"
WRITE = b"W"


@dataclass(frozen=True)
class NodeOp:
    op: bytes
    offset: int
    length: int

    def __post_init__(self):
        if self.op not in (READ, WRITE):
            raise ValueError(f"unknown node op {self.op!r}")

    def encode(self) -> bytes:
        return _HEADER.pack(self.op, self.offset, self.length)

    @classmethod
    def decode(cls, header: bytes) -> "NodeOp":
        if len(header) != _HEADER.size:
            raise ValueError("bad node request header")
        return cls(*_HEADER.unpack(header))
