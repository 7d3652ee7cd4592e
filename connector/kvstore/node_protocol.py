"""The storage node's transport requests: read or write `length` bytes at `offset`, with the
master's capability for exactly that range (connector/kvstore/auth.py); a store run without
a store secret sends none and its nodes check none."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from pdserve.connector.kvstore.auth import CAPABILITY

_HEADER = struct.Struct("!cQQ")
READ = b"R"
WRITE = b"W"


@dataclass(frozen=True)
class NodeOp:
    op: bytes
    offset: int
    length: int
    capability: bytes = b""

    def __post_init__(self):
        if self.op not in (READ, WRITE):
            raise ValueError(f"unknown node op {self.op!r}")
        if len(self.capability) not in (0, CAPABILITY.size):
            raise ValueError("bad capability")

    def encode(self) -> bytes:
        return _HEADER.pack(self.op, self.offset, self.length) + self.capability

    @classmethod
    def decode(cls, header: bytes) -> "NodeOp":
        if len(header) not in (_HEADER.size, _HEADER.size + CAPABILITY.size):
            raise ValueError("bad node request header")
        return cls(*_HEADER.unpack(header[:_HEADER.size]), header[_HEADER.size:])
