"""The frame prefix both transports put before a header: (kind, header length, payload length)."""

from __future__ import annotations

import struct

from pdserve.connector.transport.base import RemoteError

PREFIX = struct.Struct("!BIQ")
KIND_REQUEST = 0
KIND_OK = 1
KIND_ERROR = 2
# A header is metadata (keys, offsets); a cap keeps a corrupt prefix from allocating gigabytes.
MAX_HEADER = 64 * 1024


def pack(kind: int, header: bytes, payload_len: int) -> bytes:
    if len(header) > MAX_HEADER:
        raise ValueError(f"header of {len(header)} bytes exceeds {MAX_HEADER}")
    return PREFIX.pack(kind, len(header), payload_len) + header


def unpack(prefix: bytes | memoryview) -> tuple[int, int, int]:
    kind, header_len, payload_len = PREFIX.unpack(prefix[:PREFIX.size])
    if header_len > MAX_HEADER or kind not in (KIND_REQUEST, KIND_OK, KIND_ERROR):
        raise ValueError("corrupt frame prefix")
    return kind, header_len, payload_len


def raise_if_error(kind: int, header: bytes) -> None:
    if kind == KIND_ERROR:
        raise RemoteError(header.decode("utf-8", "replace"))


def error_header(exc: BaseException) -> bytes:
    return f"{type(exc).__name__}: {exc}".encode()[:MAX_HEADER]


def landing_buffer(given: memoryview | None, nbytes: int) -> memoryview:
    """`given[:nbytes]` when it fits, else a fresh buffer (a caller's too-small `out`)."""
    if given is not None and len(given) >= nbytes:
        return given[:nbytes]
    return memoryview(bytearray(nbytes))
