"""The KV transport interface: request/response of (header bytes, payload buffer).

A server `listen`s with a `RequestHandler`; a client `connect`s and sends requests. Each
message is a small header (metadata, encoded by the caller) and a payload buffer (KV bytes).
Payloads are never copied by the interface itself: the handler says where an incoming payload
lands (`payload_buffer`, e.g. a slice of a storage segment) and a client may pass `out=` to
receive a response payload straight into its own buffer (e.g. a KV block).

A connection carries one request at a time (calls are serialized on it); open several
connections for parallel transfers.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Protocol, Sequence, Union

# Anything exposing a contiguous buffer: bytes, bytearray, memoryview, numpy arrays.
Buffer = Union[bytes, bytearray, memoryview]


class TransportError(ConnectionError):
    """The peer cannot be reached or the connection broke mid-request."""


class RemoteError(RuntimeError):
    """The peer's handler raised; the message is the peer's description of it."""


class FrameRejected(ValueError):
    """A handler refuses a request's payload before it is received (too large, not allowed).
    The server answers with an error and, when a payload was announced, closes the connection
    (the unread payload would leave the stream mid-frame)."""


@dataclass(frozen=True)
class Message:
    header: bytes
    payload: memoryview


class RequestHandler(Protocol):
    def payload_buffer(self, header: bytes, nbytes: int) -> memoryview | None:
        """Where an incoming payload of `nbytes` should land (at least `nbytes` long); None ->
        a fresh buffer (at most framing.MAX_FRESH_PAYLOAD). Raises FrameRejected to refuse
        the payload; nothing has been received or allocated for it then."""

    async def handle(self, header: bytes, payload: memoryview) -> tuple[bytes, Buffer]:
        """Serve one request; returns the response (header, payload)."""


class FunctionHandler:
    """A `RequestHandler` from a coroutine function; payloads land in fresh buffers of at
    most `max_payload` bytes (and never more than framing.MAX_FRESH_PAYLOAD)."""

    def __init__(self, fn: Callable[[bytes, memoryview], Awaitable[tuple[bytes, Buffer]]],
                 max_payload: int | None = None):
        self._fn = fn
        self._max = max_payload

    def payload_buffer(self, header: bytes, nbytes: int) -> memoryview | None:
        if self._max is not None and nbytes > self._max:
            raise FrameRejected(f"payload of {nbytes} bytes exceeds {self._max}")
        return None

    async def handle(self, header: bytes, payload: memoryview) -> tuple[bytes, Buffer]:
        return await self._fn(header, payload)


class Connection(abc.ABC):
    @abc.abstractmethod
    async def request(self, header: bytes, payload: Buffer = b"",
                      out: memoryview | None = None) -> Message:
        """Send one request and wait for its response.

        `out`, when given, receives the response payload (the returned `Message.payload` is
        then a view of it); a peer that sends more than `out` holds (or, without `out`, more
        than framing.MAX_FRESH_PAYLOAD) breaks the connection before anything is allocated.
        Raises TransportError when the connection fails or the peer's frame is refused, and
        RemoteError when the peer's handler raised.
        """

    async def pipeline(self, requests: Sequence[tuple[bytes, Buffer]],
                       before_send: Optional[Callable[[int], Awaitable[None]]] = None,
                       on_reply: Optional[Callable[[int, "Message | RemoteError"], None]] = None
                       ) -> list["Message | RemoteError"]:
        """Send the requests in order (request i after `before_send(i)`) and return their
        answers in order: a Message, or the RemoteError of a request the peer refused, each
        also given to `on_reply(i, answer)` as it arrives. Where the transport can (TCP:
        connector/transport/pipeline.py) a request goes out before the ones ahead of it are
        answered; here, one at a time. A broken connection raises TransportError, and an
        exception of `before_send` ends the pipeline too (raised as it is): the requests
        not answered by then did not complete (and a TCP connection is closed). Payloads
        must stay unchanged until this returns or raises."""
        answers = []
        for i, (header, payload) in enumerate(requests):
            if before_send is not None:
                await before_send(i)
            try:
                answer = await self.request(header, payload)
            except RemoteError as exc:
                answer = exc
            if on_reply is not None:
                on_reply(i, answer)
            answers.append(answer)
        return answers

    @property
    def usable(self) -> bool:
        """False once the connection is known broken or closed (a pool drops it then)."""
        return True

    @abc.abstractmethod
    async def close(self) -> None: ...


class Listener(abc.ABC):
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @abc.abstractmethod
    async def close(self) -> None: ...


class Transport(abc.ABC):
    name: str

    @abc.abstractmethod
    async def connect(self, addr: str) -> Connection:
        """Connect to "host:port"; raises TransportError if nobody listens there."""

    @abc.abstractmethod
    async def listen(self, host: str, port: int, handler: RequestHandler) -> Listener:
        """Serve `handler` on host:port (0 -> a free port; see `Listener.port`)."""


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"transport address must be host:port, got {addr!r}")
    return host, int(port)


def as_bytes_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer (numpy arrays included)."""
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
