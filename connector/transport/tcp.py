"""Plain TCP transport on asyncio's non-blocking socket API.

Lifecycle: `TcpTransport.listen` binds a socket and runs an accept task; each accepted
connection gets a task that reads a request, lets the handler name the payload's landing
buffer, receives straight into it, runs the handler and writes the response. `connect`
returns a `TcpConnection` that serializes its requests; `close` on either side cancels the
tasks and closes the sockets.

Why asyncio's `sock_recv_into`/`sock_sendall` and not StreamReader/StreamWriter: streams copy
every byte through their own buffers, while these calls read into and send from the caller's
memory, which is the zero-copy path the KV payloads need.
"""

from __future__ import annotations

import asyncio
import socket

from pdserve.connector.transport import framing
from pdserve.connector.transport.base import (Buffer, Connection, FrameRejected, Listener,
                                              Message, RequestHandler, Transport,
                                              TransportError, as_bytes_view, split_addr)

_REQUESTS = (framing.KIND_REQUEST,)
_RESPONSES = (framing.KIND_OK, framing.KIND_ERROR)
MAX_CONNECTIONS = 1024  # per listener; more are closed on accept (each holds a task)


# TCP keepalive: a peer that vanished (power loss, partition) is found within about
# IDLE + INTERVAL * COUNT seconds on an idle connection, instead of never.
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers are tiny
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                       ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, opt):  # Linux has all three; others keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    sock.setblocking(False)


async def _recv_exact(loop, sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise TransportError("connection closed by peer")
        got += n


async def _send_frame(loop, sock, kind: int, header: bytes, payload: memoryview) -> None:
    await loop.sock_sendall(sock, framing.pack(kind, header, len(payload)))
    if len(payload):
        await loop.sock_sendall(sock, payload)


async def _recv_head(loop, sock, kinds: tuple[int, ...]) -> tuple[int, bytes, int]:
    prefix = bytearray(framing.PREFIX.size)
    await _recv_exact(loop, sock, memoryview(prefix))
    kind, header_len, payload_len = framing.unpack(prefix, kinds)
    header = bytearray(header_len)
    await _recv_exact(loop, sock, memoryview(header))
    return kind, bytes(header), payload_len


class TcpConnection(Connection):
    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._lock = asyncio.Lock()
        self._broken = False

    async def request(self, header: bytes, payload: Buffer = b"",
                      out: memoryview | None = None) -> Message:
        loop = asyncio.get_running_loop()
        async with self._lock:
            if self._broken:
                raise TransportError("connection is closed")
            try:
                await _send_frame(loop, self._sock, framing.KIND_REQUEST, header,
                                  as_bytes_view(payload))
                kind, rheader, payload_len = await _recv_head(loop, self._sock, _RESPONSES)
                rpayload = framing.response_landing(out, payload_len)
                await _recv_exact(loop, self._sock, rpayload)
            except (OSError, ValueError, asyncio.CancelledError) as exc:
                # A half-done exchange leaves the stream mid-frame: the connection is unusable.
                self._broken = True
                self._sock.close()
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise TransportError(f"tcp request failed: {exc}") from exc
        framing.raise_if_error(kind, rheader)
        return Message(rheader, rpayload)

    async def close(self) -> None:
        self._broken = True
        self._sock.close()


class TcpListener(Listener):
    def __init__(self, sock: socket.socket, handler: RequestHandler):
        self._sock = sock
        self._handler = handler
        self.host, self.port = sock.getsockname()[:2]
        self._tasks: set[asyncio.Task] = set()
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            if len(self._tasks) >= MAX_CONNECTIONS:
                conn.close()
                continue
            _tune(conn)
            task = loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                _, header, payload_len = await _recv_head(loop, conn, _REQUESTS)
                try:
                    payload = framing.request_landing(self._handler, header, payload_len)
                except FrameRejected as exc:
                    await _send_frame(loop, conn, framing.KIND_ERROR, framing.error_header(exc),
                                      memoryview(b""))
                    if payload_len:
                        return  # its payload is still on the wire: the stream is unusable
                    continue
                await _recv_exact(loop, conn, payload)
                try:
                    rheader, rpayload = await self._handler.handle(header, payload)
                    rkind = framing.KIND_OK
                except Exception as exc:  # the client gets it as a RemoteError
                    rheader, rpayload, rkind = framing.error_header(exc), b"", framing.KIND_ERROR
                await _send_frame(loop, conn, rkind, rheader, as_bytes_view(rpayload))
        except (TransportError, OSError, ValueError):
            pass  # the client went away (or sent garbage): drop this connection only
        finally:
            conn.close()

    async def close(self) -> None:
        self._accept_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(self._accept_task, *self._tasks, return_exceptions=True)
        self._sock.close()


class TcpTransport(Transport):
    name = "tcp"

    async def connect(self, addr: str) -> Connection:
        host, port = split_addr(addr)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                             socket.SOCK_STREAM)
        _tune(sock)
        try:
            await loop.sock_connect(sock, (host, port))
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot connect to {addr}: {exc}") from exc
        return TcpConnection(sock)

    async def listen(self, host: str, port: int, handler: RequestHandler) -> Listener:
        sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        sock.setblocking(False)
        return TcpListener(sock, handler)
