"""The frame prefix both transports put before a header: (kind, header length, payload length),
and the size checks every side applies to a peer's frame before it allocates anything.

Limits: a header is at most MAX_HEADER bytes. A request payload lands where the server's
handler says (`RequestHandler.payload_buffer`, which may refuse it with FrameRejected) or, when
the handler names no buffer, in a fresh one of at most MAX_FRESH_PAYLOAD bytes. A response
payload lands in the caller's `out` and may not exceed it, or in a fresh buffer of at most
MAX_FRESH_PAYLOAD bytes. So a peer's length field never drives an allocation beyond these.
"""

from __future__ import annotations

import struct

from pdserve.connector.transport.base import FrameRejected, RemoteError, RequestHandler

PREFIX = struct.Struct("!BIQ")
KIND_REQUEST = 0
KIND_OK = 1
KIND_ERROR = 2
# A header is metadata (keys, offsets); a cap keeps a corrupt prefix from allocating gigabytes.
MAX_HEADER = 64 * 1024
# A payload nobody named a landing buffer for (echo servers, acks, error replies).
MAX_FRESH_PAYLOAD = 16 << 20


class FrameTooLarge(FrameRejected):
    """A peer announced more bytes than the receiver accepts."""


def pack(kind: int, header: bytes, payload_len: int) -> bytes:
    if len(header) > MAX_HEADER:
        raise ValueError(f"header of {len(header)} bytes exceeds {MAX_HEADER}")
    return PREFIX.pack(kind, len(header), payload_len) + header


def unpack(prefix: bytes | memoryview, kinds: tuple[int, ...] = (KIND_REQUEST, KIND_OK,
                                                                  KIND_ERROR)
           ) -> tuple[int, int, int]:
    """(kind, header length, payload length); ValueError for a kind not in `kinds` or an
    oversized header. The payload length is checked by the landing functions below."""
    kind, header_len, payload_len = PREFIX.unpack(prefix[:PREFIX.size])
    if kind not in kinds:
        raise ValueError(f"unexpected frame kind {kind}")
    if header_len > MAX_HEADER:
        raise FrameTooLarge(f"frame header of {header_len} bytes exceeds {MAX_HEADER}")
    return kind, header_len, payload_len


def _fresh(nbytes: int, what: str) -> memoryview:
    if nbytes > MAX_FRESH_PAYLOAD:
        raise FrameTooLarge(f"{what} payload of {nbytes} bytes exceeds {MAX_FRESH_PAYLOAD}")
    return memoryview(bytearray(nbytes))


def request_landing(handler: RequestHandler, header: bytes, nbytes: int) -> memoryview:
    """Server side: where a request's payload lands. Raises FrameRejected (the handler's, or
    FrameTooLarge) before anything is allocated or received."""
    given = handler.payload_buffer(header, nbytes)
    if given is None:
        return _fresh(nbytes, "request")
    if len(given) < nbytes:
        raise FrameTooLarge(f"request payload of {nbytes} bytes exceeds its {len(given)}-byte "
                            "landing buffer")
    return given[:nbytes]


def response_landing(out: memoryview | None, nbytes: int) -> memoryview:
    """Client side: where a response's payload lands: `out[:nbytes]`, or a fresh buffer when
    no `out` was given. Raises FrameTooLarge when the peer sends more than that allows."""
    if out is None:
        return _fresh(nbytes, "response")
    if nbytes > len(out):
        raise FrameTooLarge(f"response payload of {nbytes} bytes exceeds the {len(out)}-byte "
                            "buffer it was asked into")
    return out[:nbytes]


def raise_if_error(kind: int, header: bytes) -> None:
    if kind == KIND_ERROR:
        raise RemoteError(header.decode("utf-8", "replace"))


def error_header(exc: BaseException) -> bytes:
    return f"{type(exc).__name__}: {exc}".encode()[:MAX_HEADER]
