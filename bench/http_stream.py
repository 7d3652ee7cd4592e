"""A minimal streaming HTTP/1.1 client for the load generator, on an asyncio Protocol.

Why not httpx: on a 2-core box the client shares the cores with the engine's forward, and
every CPU cycle it spends per streamed token lands on the measured ITL. httpx cost 0.19-0.22 ms
of CPU per token (its stream reader, h11, the line decoder and an await per chunk); this
parses in `data_received`, hands each SSE `data:` payload to a callback with the read's arrival
time, and costs no task switch per token.

What it speaks: one request per connection (`Connection: close`), a JSON POST or a GET; the
response's status line and headers, then a body framed by chunked transfer encoding, by
Content-Length, or by the connection's end. A 200 body is split into SSE lines as it arrives
(at \\n only, a trailing \\r dropped: a token may hold U+2028 raw); any other status collects
the body (bounded) as the error's text. Everything the server controls is bounded: the header
block, a chunk-size line, one SSE line, an error body.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass
from typing import Callable, Optional
from urllib.parse import urlsplit

# (payload of one `data:` line, perf_counter time of the read that completed it) -> False to
# ignore the rest of the events ([DONE]); the body is still read to its end
EventSink = Callable[[str, float], bool]


class HttpStreamError(Exception):
    """The response broke the protocol or a bound; the request failed."""


@dataclass(frozen=True)
class StreamLimits:
    max_header_bytes: int = 64 * 1024  # status line + headers
    max_line_bytes: int = 1024 * 1024  # one SSE line (an event with a whole long text)
    max_error_body_bytes: int = 64 * 1024  # kept of a non-200 body (the rest is dropped)
    max_body_bytes: int = 8 * 1024 * 1024  # a non-streamed 200 body (GET /v1/models)

    def __post_init__(self):
        for name in ("max_header_bytes", "max_line_bytes", "max_error_body_bytes",
                     "max_body_bytes"):
            if getattr(self, name) < 256:
                raise ValueError(f"{name} must be >= 256, got {getattr(self, name)}")


@dataclass(frozen=True)
class Endpoint:
    """Where requests go, from a base URL such as http://127.0.0.1:8000 (a path prefix kept)."""
    host: str
    port: int
    tls: bool
    prefix: str

    @classmethod
    def parse(cls, base_url: str) -> "Endpoint":
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"want http(s)://host[:port][/prefix], got {base_url!r}")
        tls = u.scheme == "https"
        return cls(u.hostname, u.port or (443 if tls else 80), tls, u.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class Response:
    """A finished response: status, and the body of a non-streamed or non-200 answer."""
    status: int
    body: bytes


class _Protocol(asyncio.Protocol):
    """One request's connection: head -> body (framing) -> SSE lines or a collected body."""

    def __init__(self, request: bytes, sink: Optional[EventSink], limits: StreamLimits):
        self._request, self._sink, self._lim = request, sink, limits
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._transport = None
        self._head = bytearray()  # until the blank line ends the headers
        self._status = 0
        self._chunked, self._remaining = False, -1  # framing: -1 = until the connection ends
        self._cbuf = bytearray()  # chunked framing not yet read
        self._need, self._after_data = 0, False  # bytes left in this chunk; its CRLF pending
        self._line = bytearray()  # the SSE line being received
        self._body = bytearray()  # non-SSE body
        self._events_on = True  # False after the sink said stop
        self._t = 0.0

    def connection_made(self, transport) -> None:
        self._transport = transport
        transport.write(self._request)

    def connection_lost(self, exc) -> None:
        if self.done.done():
            return
        if self._status and self._remaining < 0 and not self._chunked:
            self._finish()  # framed by the connection's end
        else:
            self._fail(HttpStreamError(f"connection closed before the response ended"
                                       f"{': ' + str(exc) if exc else ''}"))

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        self._t = time.perf_counter()
        try:
            if not self._status:
                data = self._read_head(data)
                if data is None or self.done.done():
                    return
            self._read_body(data)
        except HttpStreamError as exc:
            self._fail(exc)
        except Exception as exc:  # a bad number or event: the sink parses what a peer sent
            self._fail(HttpStreamError(f"{type(exc).__name__}: {exc}"))

    def _read_head(self, data: bytes) -> Optional[bytes]:
        """Buffers the head; once whole, parses it and returns the body bytes after it."""
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > self._lim.max_header_bytes:
                raise HttpStreamError("response headers over the limit")
            return None
        if end > self._lim.max_header_bytes:
            raise HttpStreamError("response headers over the limit")
        lines = bytes(self._head[:end]).decode("latin-1").split("\r\n")
        rest = bytes(self._head[end + 4:])
        self._head = bytearray()
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HttpStreamError(f"bad status line {lines[0][:100]!r}")
        self._status = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "transfer-encoding" and "chunked" in value.lower():
                self._chunked = True
            elif name == "content-length":
                self._remaining = int(value)  # ValueError: not a number
                if self._remaining < 0:
                    raise HttpStreamError(f"bad Content-Length {value[:40]!r}")
        if self._chunked:
            self._remaining = -1
        elif self._remaining == 0:
            self._finish()
        return rest

    def _read_body(self, data: bytes) -> None:
        if not self._chunked:
            if self._remaining >= 0:
                data = data[:self._remaining]
                self._remaining -= len(data)
            self._content(data)
            if self._remaining == 0:
                self._finish()
            return
        buf = self._cbuf
        buf += data
        pos = 0
        while not self.done.done():
            if self._need:
                take = min(self._need, len(buf) - pos)
                if not take:
                    break
                self._content(bytes(buf[pos:pos + take]))
                pos += take
                self._need -= take
                self._after_data = not self._need
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if len(buf) - pos > 1024:
                    raise HttpStreamError("chunk-size line over 1024 bytes")
                break
            line, pos = bytes(buf[pos:end]), end + 2
            if self._after_data:  # the CRLF that closes a chunk's data
                if line:
                    raise HttpStreamError("chunk data longer than its size")
                self._after_data = False
                continue
            size = int(line.split(b";", 1)[0], 16)  # ValueError: a bad size line
            if size < 0:
                raise HttpStreamError("negative chunk size")
            if size == 0:  # the last chunk; trailers, if any, are not read
                self._finish()
                break
            self._need = size
        del buf[:pos]

    def _content(self, data: bytes) -> None:
        if self._status == 200 and self._sink is not None:
            self._sse(data)
            return
        cap = self._lim.max_body_bytes if self._status == 200 else self._lim.max_error_body_bytes
        if self._status == 200 and len(self._body) + len(data) > cap:
            raise HttpStreamError("response body over the limit")
        self._body += data[:max(0, cap - len(self._body))]

    def _sse(self, data: bytes) -> None:
        pend = self._line
        pend += data
        start, cap = 0, self._lim.max_line_bytes
        while True:
            nl = pend.find(b"\n", start)
            if nl < 0:
                break
            if nl - start > cap:
                raise HttpStreamError(f"an event line over {cap} bytes")
            if self._events_on and pend.startswith(b"data:", start):
                payload = bytes(pend[start + 5:nl]).strip().decode("utf-8", "replace")
                self._events_on = self._sink(payload, self._t)
            start = nl + 1
        del pend[:start]
        if len(pend) > cap:
            raise HttpStreamError(f"an event line over {cap} bytes")

    def _finish(self) -> None:
        if not self.done.done():
            if self._status == 200 and self._sink is not None and self._line.strip():
                self._sse(b"\n")  # a last line without its newline
            self.done.set_result(Response(self._status, bytes(self._body)))
        self._transport.close()

    def _fail(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        if self._transport is not None:
            self._transport.abort()


def _request_bytes(ep: Endpoint, method: str, path: str, body: Optional[bytes]) -> bytes:
    head = (f"{method} {ep.prefix}{path} HTTP/1.1\r\nHost: {ep.host_header}\r\n"
            "Accept: text/event-stream, application/json\r\nConnection: close\r\n")
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode("latin-1") + b"\r\n" + (body or b"")


async def request(ep: Endpoint, method: str, path: str, payload: Optional[dict] = None,
                  sink: Optional[EventSink] = None, timeout_s: float = 600.0,
                  connect_timeout_s: float = 30.0,
                  limits: StreamLimits = StreamLimits()) -> Response:
    """One request on a new connection. With a sink, a 200 body is streamed to it as SSE
    events; otherwise (and for any other status) the body comes back in the Response.
    Raises HttpStreamError, OSError or asyncio.TimeoutError when the exchange fails."""
    body = None if payload is None else json.dumps(payload).encode()
    loop = asyncio.get_running_loop()
    ctx = ssl.create_default_context() if ep.tls else None
    proto = _Protocol(_request_bytes(ep, method, path, body), sink, limits)
    transport, _ = await asyncio.wait_for(
        loop.create_connection(lambda: proto, ep.host, ep.port, ssl=ctx,
                               server_hostname=ep.host if ctx else None), connect_timeout_s)
    try:
        return await asyncio.wait_for(proto.done, timeout_s)
    finally:
        transport.abort()  # after a timeout or a cancellation; a no-op once closed
