"""Zero-copy sends on Linux: the payload's pages go to the socket by reference, not by copy.

`vmsplice` maps the caller's pages into a pipe and `splice` moves them from the pipe into the
socket's send queue; the kernel copies nothing on the sending side (a plain `send` copies every
byte into socket buffers). On loopback the receiver then copies once, straight from the
caller's pages. That halves the CPU a block costs to send, which on a host with few cores is
what leaves room for the block MAC.

Why it is safe here: the pages are referenced, not copied, so bytes changed before the peer
has read them would go out changed. A `TcpConnection` request does not return before the
peer's response, which the peer sends after it has read the whole payload, so the caller
cannot touch its buffer while a byte of it is in flight. A request that fails mid-way closes
its socket with an abortive reset (SO_LINGER 0: queued bytes are discarded, never sent).

Where `vmsplice` is missing (not Linux) or refused, `Splicer.open` returns None and the
connection sends with plain `sock_sendall`.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import os
import socket
from typing import Optional

from pdserve.connector.cbuf import pinned_address
from pdserve.connector.transport.fd_wait import fd_ready

_F_SETPIPE_SZ = 1031  # linux/fcntl.h (F_LINUX_SPECIFIC_BASE + 7)
_F_GETPIPE_SZ = 1032
_SPLICE_F_MOVE = 1
_SPLICE_F_NONBLOCK = 2
_SPLICE_F_MORE = 4
PIPE_BYTES = 1 << 20  # pages per vmsplice/splice round: /proc/sys/fs/pipe-max-size's default
MIN_SPLICE_BYTES = 64 << 10  # below this a copy costs less than the two extra syscalls
# From here on a copy costs less again, against a storage node's thread-per-connection
# listener (tcp_threads.py): on the 2-core Zen 5 EPYC, one put of 1 MiB cost the client
# ~360 us of CPU spliced and ~120 copied, 2 MiB ~790 against ~280 (a payload larger than
# the socket's send queue goes out in rounds, each an event-loop wait), while up to
# 0.7 MiB the spliced put cost the same or less (2026-12-02, short probes, load ~3).
MAX_SPLICE_BYTES = PIPE_BYTES


def spliced(nbytes: int) -> bool:
    """Whether a payload of `nbytes` is sent by reference (when the connection can)."""
    return MIN_SPLICE_BYTES <= nbytes < MAX_SPLICE_BYTES


class SpliceRefused(OSError):
    """vmsplice took none of a payload (memory it cannot map): send it by copy instead."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.lru_cache(maxsize=1)
def _vmsplice():
    """libc's vmsplice, or None (loaded once per process; a ctypes call releases the GIL)."""
    if not hasattr(os, "splice"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).vmsplice
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    return fn


class Splicer:
    """One connection's pipe for zero-copy sends. Not shared: a connection sends one payload
    at a time. `close` closes the pipe."""

    def __init__(self, fn, r: int, w: int, capacity: int):
        self._vmsplice, self._r, self._w, self.capacity = fn, r, w, capacity

    @classmethod
    def open(cls) -> Optional["Splicer"]:
        fn = _vmsplice()
        if fn is None:
            return None
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:  # over the user's pipe quota: the default size still works
            pass
        return cls(fn, r, w, fcntl.fcntl(w, _F_GETPIPE_SZ))

    async def send(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                   view: memoryview) -> None:
        """All of `view` into `sock` (non-blocking), by reference. The pipe is empty between
        calls: each round moves every byte it took in before the next one."""
        keep, address = pinned_address(view)
        fd, sent, total = sock.fileno(), 0, view.nbytes
        while sent < total:
            iov = _IoVec(address + sent, min(self.capacity, total - sent))
            n = self._vmsplice(self._w, ctypes.byref(iov), 1, _SPLICE_F_NONBLOCK)
            if n <= 0:
                err = ctypes.get_errno()
                if sent == 0:  # nothing of this payload is out: the caller may copy it
                    raise SpliceRefused(err, f"vmsplice: {os.strerror(err)}")
                raise OSError(err, f"vmsplice: {os.strerror(err)}")
            # SPLICE_F_MORE until the last round: the socket sends full segments, then pushes
            more = _SPLICE_F_MORE if sent + n < total else 0
            while n:
                try:
                    moved = os.splice(self._r, fd, n,
                                      flags=_SPLICE_F_MOVE | _SPLICE_F_NONBLOCK | more)
                except BlockingIOError:
                    await fd_ready(loop, fd, write=True)
                    continue
                if moved == 0:
                    raise OSError(errno.EPIPE, "splice: the socket took nothing")
                n -= moved
                sent += moved
        del keep  # the pages are the kernel's (referenced) until the peer has read them

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)
