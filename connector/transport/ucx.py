"""UCX transport through `ucxx` (tag send/recv on endpoints).

Lifecycle: the first `UcxTransport` use initializes the process-wide UCX context (ucxx keeps
one per process) with this transport's options and progress mode; later transports in the same
process reuse it. `listen` creates a ucxx listener whose callback serves one endpoint until the
peer closes it; `connect` creates an endpoint wrapped in a `UcxConnection`. Closing the
listener stops accepting and cancels the serving tasks; closing a connection closes its
endpoint. See UCX_NOTES.md for the settings and why they matter for speed over TCP.

Wire format per message: one tag message holding prefix + header, then (when non-empty) one
tag message holding the payload, received straight into the landing buffer. UCX keeps tag
messages on one endpoint in order, and a connection carries one request at a time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdserve.connector.transport import framing
from pdserve.connector.transport.base import (Buffer, Connection, FrameRejected, Listener,
                                              Message, RequestHandler, Transport,
                                              TransportError, as_bytes_view, split_addr)

_FRAME_MAX = framing.PREFIX.size + framing.MAX_HEADER
_REQUESTS = (framing.KIND_REQUEST,)
_RESPONSES = (framing.KIND_OK, framing.KIND_ERROR)
_PROGRESS_MODES = ("blocking", "polling", "thread", "thread-polling")

# Measured on loopback (UCX_NOTES.md): TCP only (the store is multi-host; shared memory
# would only help same-host peers), 64 KiB TCP segments instead of 8 KiB (fewer sends and
# progress calls per MiB), and eager protocol for every size: UCX's rendezvous over TCP adds
# handshakes that each need the receiver's progress, which stalls under CPU contention.
DEFAULT_UCX_OPTIONS = {
    "TLS": "tcp,self",
    "TCP_TX_SEG_SIZE": "64k",
    "TCP_RX_SEG_SIZE": "64k",
    "RNDV_THRESH": "inf",
    "WARN_UNUSED_ENV_VARS": "n",  # ucxx itself sets UCX_MEMTYPE_CACHE, which UCX 1.21 lacks
}


@dataclass(frozen=True)
class UcxConfig:
    # "blocking" (progress on the worker's epoll fd, in the event loop) beat the default
    # "thread" by 3x in throughput and 10x in round trip on 2 shared cores: the progress
    # thread fights the event loop for the GIL and the cores.
    progress_mode: str = "blocking"
    options: dict = field(default_factory=lambda: dict(DEFAULT_UCX_OPTIONS))

    def __post_init__(self):
        if self.progress_mode not in _PROGRESS_MODES:
            raise ValueError(f"progress_mode must be one of {_PROGRESS_MODES}")


def _ucx_errors() -> tuple[type[BaseException], ...]:
    import ucxx.exceptions

    return (ucxx.exceptions.UCXError,)


def ensure_initialized(cfg: UcxConfig) -> None:
    """Start UCX for this process with `cfg` unless something already started it."""
    import ucxx
    import ucxx.core

    if ucxx.core._ctx is not None:  # ucxx owns the context; a second init would raise
        return
    # UCX_* variables the operator set win over our defaults (they tune a real deployment).
    ucxx.init(options=cfg.options, env_takes_precedence=True,
              progress_mode=cfg.progress_mode)


async def _send_frame(ep, kind: int, header: bytes, payload: memoryview) -> None:
    await ep.send(framing.pack(kind, header, len(payload)))
    if len(payload):
        await ep.send(payload)


async def _recv_frame_head(ep, frame: bytearray, kinds: tuple[int, ...]
                           ) -> tuple[int, bytes, int]:
    await ep.recv(frame)  # a shorter message lands in the front of the buffer
    kind, header_len, payload_len = framing.unpack(frame, kinds)
    start = framing.PREFIX.size
    return kind, bytes(frame[start:start + header_len]), payload_len


class UcxConnection(Connection):
    def __init__(self, ep):
        self._ep = ep
        self._lock = asyncio.Lock()
        self._frame = bytearray(_FRAME_MAX)
        self._broken = False

    async def request(self, header: bytes, payload: Buffer = b"",
                      out: memoryview | None = None) -> Message:
        async with self._lock:
            if self._broken:
                raise TransportError("connection is closed")
            try:
                await _send_frame(self._ep, framing.KIND_REQUEST, header, as_bytes_view(payload))
                kind, rheader, payload_len = await _recv_frame_head(self._ep, self._frame,
                                                                    _RESPONSES)
                rpayload = framing.response_landing(out, payload_len)
                if payload_len:
                    await self._ep.recv(rpayload)
            except (*_ucx_errors(), ValueError) as exc:
                self._broken = True
                raise TransportError(f"ucx request failed: {exc}") from exc
        framing.raise_if_error(kind, rheader)
        return Message(rheader, rpayload)

    async def close(self) -> None:
        self._broken = True
        if not self._ep.closed:
            await self._ep.close()


class UcxListener(Listener):
    def __init__(self, host: str, port: int, handler: RequestHandler):
        import ucxx

        self._handler = handler
        self._tasks: set[asyncio.Task] = set()
        # ucxx listens on every interface; `host` is what peers are told to dial.
        self._listener = ucxx.create_listener(self._on_connect, port=port)
        self.host, self.port = host, self._listener.port

    async def _on_connect(self, ep) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._serve(ep)
        finally:
            self._tasks.discard(task)
            if not ep.closed:
                ep.abort()

    async def _serve(self, ep) -> None:
        frame = bytearray(_FRAME_MAX)
        try:
            while True:
                _, header, payload_len = await _recv_frame_head(ep, frame, _REQUESTS)
                try:
                    payload = framing.request_landing(self._handler, header, payload_len)
                except FrameRejected as exc:
                    await _send_frame(ep, framing.KIND_ERROR, framing.error_header(exc),
                                      memoryview(b""))
                    if payload_len:
                        return  # its payload message is still pending: drop the endpoint
                    continue
                if payload_len:
                    await ep.recv(payload)
                try:
                    rheader, rpayload = await self._handler.handle(header, payload)
                    rkind = framing.KIND_OK
                except Exception as exc:  # the client gets it as a RemoteError
                    rheader, rpayload, rkind = framing.error_header(exc), b"", framing.KIND_ERROR
                await _send_frame(ep, rkind, rheader, as_bytes_view(rpayload))
        except (*_ucx_errors(), ValueError):
            pass  # the client closed its endpoint (or sent garbage): this endpoint is done

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._listener.close()


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, cfg: UcxConfig | None = None):
        self._cfg = cfg or UcxConfig()

    async def connect(self, addr: str) -> Connection:
        import ucxx

        ensure_initialized(self._cfg)
        host, port = split_addr(addr)
        try:
            ep = await ucxx.create_endpoint(host, port)
        except (*_ucx_errors(), OSError, asyncio.TimeoutError) as exc:
            raise TransportError(f"cannot connect to {addr} over ucx: {exc}") from exc
        return UcxConnection(ep)

    async def listen(self, host: str, port: int, handler: RequestHandler) -> Listener:
        ensure_initialized(self._cfg)
        return UcxListener(host, port, handler)
