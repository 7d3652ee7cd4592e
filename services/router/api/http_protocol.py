"""uvicorn's h11 protocol with a request-head deadline: a connection must deliver a complete
request line and headers within `head_timeout_s` of connecting (or of its first byte after a
keep-alive pause), else it is closed. uvicorn bounds idle keep-alive connections
(timeout_keep_alive) but not a client that trickles its headers (slowloris), which would hold
a connection slot for as long as it likes."""

from __future__ import annotations

import asyncio
import functools
from typing import Optional

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimeoutH11(H11Protocol):
    head_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        self._head_timer: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_head():
            self._arm()
        super().data_received(data)
        if not self._waiting_for_head():
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

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


def head_timeout_protocol(timeout_s: float) -> type:
    """A protocol class for uvicorn.Config(http=...) with this head deadline."""
    return type("HeadTimeoutH11", (HeadTimeoutH11,), {"head_timeout_s": timeout_s})
