"""A TCP listener that serves each connection with blocking calls on a thread of its own.

Why: the asyncio listener (tcp.py) pays, per request, an event-loop round (epoll_ctl pair,
epoll_wait, a callback, a task wake-up) for every wait: for the prefix, for the payload, and
once more for the next request. A storage node's requests are short and CPU-bound (check a
capability, receive into the segment, ack), so a blocking receive on a thread per connection
(what the raw socket's server does) costs one syscall per wait instead, and the payload is
received with MSG_WAITALL: one syscall that copies each segment as it arrives, while the
sender is still sending it (cache-hot), rather than after all of it has queued.

Same frames and the same checks as the asyncio listener (framing.py): the prefix and header
are bounded, the handler names (or refuses) the payload's landing buffer before a byte of it
is received, and a refused frame with a payload closes its connection.

Bounds: at most `max_connections` connections (so threads) per listener, more are closed on
accept; a peer that stalls mid-frame (no byte for `frame_timeout_s`, e.g. SIGSTOPped) is
dropped; an idle connection (between frames) is kept, with TCP keepalive finding dead peers.
A blocking send of a response gets the same timeout. `close` shuts every socket down (waking
its thread) and joins the threads.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Protocol

from pdserve.connector.transport import framing
from pdserve.connector.transport.base import (Buffer, FrameRejected, Listener,
                                              TransportError, as_bytes_view)

_REQUESTS = (framing.KIND_REQUEST,)
_MSG_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_ACCEPT_POLL_S = 0.5  # how often the accept thread looks at the closed flag
_TIMEVAL = struct.Struct("ll")  # struct timeval (Linux, 64-bit)


class BlockingHandler(Protocol):
    """A `RequestHandler` whose requests are served without awaiting (a storage segment)."""

    def payload_buffer(self, header: bytes, nbytes: int) -> memoryview | None:
        """As RequestHandler.payload_buffer."""

    def serve(self, header: bytes, payload: memoryview) -> tuple[bytes, Buffer]:
        """Serve one request on the connection's thread; returns (header, payload)."""


class _Stalled(TransportError):
    """No byte arrived (or could be sent) for a whole frame timeout mid-frame."""


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel timeouts on a blocking socket (SO_RCVTIMEO/SO_SNDTIMEO): a wait longer than
    `seconds` fails with EAGAIN, while the socket stays in plain blocking mode (Python's own
    timeouts would poll before every call)."""
    secs = int(seconds)
    val = _TIMEVAL.pack(secs, int((seconds - secs) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, val)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, val)


def _recv_into(sock: socket.socket, view: memoryview, idle_ok: bool) -> bool:
    """Fill `view`; False on a clean EOF before its first byte (the peer hung up between
    frames). `idle_ok`: a timeout before the first byte is not a stall (an idle connection)."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:], len(view) - got, _MSG_WAITALL)
        except (BlockingIOError, TimeoutError):
            if idle_ok and got == 0:
                continue
            raise _Stalled("peer stalled mid-frame") from None
        if n == 0:
            if got == 0 and idle_ok:
                return False
            raise TransportError("connection closed by peer")
        got += n
    return True


def _send_frame(sock: socket.socket, kind: int, header: bytes, payload: memoryview) -> None:
    """Head and payload in one sendmsg (one syscall, one segment for a small response);
    what a send timeout left unsent is finished with sendall, in order."""
    head = framing.pack(kind, header, len(payload))
    try:
        sent = sock.sendmsg([head, payload] if len(payload) else [head])
        if sent < len(head):
            sock.sendall(memoryview(head)[sent:])
            sent = len(head)
        if sent - len(head) < len(payload):
            sock.sendall(payload[sent - len(head):])
    except (BlockingIOError, TimeoutError):
        raise _Stalled("peer stopped reading") from None


class ThreadedTcpListener(Listener):
    def __init__(self, sock: socket.socket, handler: BlockingHandler, *, max_connections: int,
                 frame_timeout_s: float, tune):
        if max_connections < 1 or not frame_timeout_s > 0:
            raise ValueError("max_connections must be >= 1 and frame_timeout_s positive")
        self._sock, self._handler, self._tune = sock, handler, tune
        self._max, self._timeout_s = max_connections, frame_timeout_s
        self.host, self.port = sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        sock.settimeout(_ACCEPT_POLL_S)
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"tcp-accept-{self.port}")
        self._acceptor.start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return  # the listening socket was closed
            with self._lock:
                if self._closed or len(self._conns) >= self._max:
                    conn.close()
                    continue
                th = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name=f"tcp-conn-{self.port}")
                self._conns[conn] = th
            th.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._tune(conn)
            conn.setblocking(True)
            _set_timeouts(conn, self._timeout_s)
            while not self._closed and self._serve_one(conn):
                pass
        except (TransportError, OSError, ValueError):
            pass  # the client went away, stalled or sent garbage: drop this connection only
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        """One request; False when the connection is to end (EOF, or a refused payload)."""
        prefix = memoryview(bytearray(framing.PREFIX.size))
        if not _recv_into(conn, prefix, idle_ok=True):
            return False
        _, header_len, payload_len = framing.unpack(prefix, _REQUESTS)
        header = bytearray(header_len)
        _recv_into(conn, memoryview(header), idle_ok=False)
        header = bytes(header)
        try:
            payload = framing.request_landing(self._handler, header, payload_len)
        except FrameRejected as exc:
            _send_frame(conn, framing.KIND_ERROR, framing.error_header(exc), memoryview(b""))
            return not payload_len  # its payload is still on the wire: the stream is unusable
        _recv_into(conn, payload, idle_ok=False)
        try:
            rheader, rpayload = self._handler.serve(header, payload)
            rkind = framing.KIND_OK
        except Exception as exc:  # the client gets it as a RemoteError
            rheader, rpayload, rkind = framing.error_header(exc), b"", framing.KIND_ERROR
        _send_frame(conn, rkind, rheader, as_bytes_view(rpayload))
        return True

    def _shutdown_all(self) -> list[threading.Thread]:
        with self._lock:
            self._closed = True
            conns = dict(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # Linux: wakes the acceptor at once
        except OSError:
            pass  # elsewhere it sees the flag within _ACCEPT_POLL_S
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or send
            except OSError:
                pass
        return [self._acceptor, *conns.values()]

    async def close(self) -> None:
        threads = self._shutdown_all()
        await asyncio.to_thread(lambda: [t.join() for t in threads])
        self._sock.close()
