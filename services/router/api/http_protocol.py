"""uvicorn's h11 protocol with a request-head deadline: a connection must deliver a complete
request line and headers within `head_timeout_s` of connecting (or of its first byte after a
keep-alive pause), else it is closed. uvicorn bounds idle keep-alive connections
(timeout_keep_alive) but not a client that trickles its headers (slowloris), which would hold
a connection slot for as long as it likes.
The head's size is bounded here too (`max_head_bytes`, request line and headers): h11's
max_incomplete_event_size only bounds a head still incomplete in its buffer, so a larger head
that arrived in one read was parsed whole (a 16 KB head passed a 4 KB limit). A head over the
limit gets an OpenAI-shaped 431 and the connection is closed, before h11 sees it."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


_HEAD_END = b"\r\n\r\n"


class HeadTimeoutH11(H11Protocol):
    head_timeout_s = 10.0
    max_head_bytes = 64 * 1024

    def connection_made(self, transport) -> None:
        self._head_timer: Optional[asyncio.TimerHandle] = None
        self._head_len = 0  # bytes of the head being received so far
        self._head_tail = b""  # its last 3 bytes (the end marker may span two reads)
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_head():
            self._arm()
            # the client between requests (not still sending a refused request's body)
            if self.conn.their_state is h11.IDLE and self._head_too_large(data):
                self._refuse_head()
                return
        super().data_received(data)
        if not self._waiting_for_head():
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _head_too_large(self, data: bytes) -> bool:
        window = self._head_tail + data
        end = window.find(_HEAD_END)
        if end >= 0:  # the head ends here: the next one starts from zero
            size = self._head_len - len(self._head_tail) + end + len(_HEAD_END)
            self._head_len, self._head_tail = 0, b""
            return size > self.max_head_bytes
        self._head_len += len(data)
        self._head_tail = window[-3:]
        return self._head_len > self.max_head_bytes

    def _refuse_head(self) -> None:
        from pdserve.services.router.api.errors import bad_request

        body = json.dumps(bad_request(
            f"request line and headers exceed {self.max_head_bytes} bytes",
            code="request_header_fields_too_large", status=431).to_json()).encode()
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                             b"content-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n" % len(body) + body)
        self._disarm()
        self.transport.close()

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expired(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()


def head_timeout_protocol(timeout_s: float, max_head_bytes: int = 64 * 1024) -> type:
    """A protocol class for uvicorn.Config(http=...) with this head deadline and size."""
    return type("HeadTimeoutH11", (HeadTimeoutH11,), {"head_timeout_s": timeout_s,
                                                       "max_head_bytes": max_head_bytes})
