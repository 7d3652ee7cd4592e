"""KV transports: UCX (ucxx) and plain TCP behind one interface (see base.py).

`make_transport(kind)` picks one: "ucx", "tcp", or "auto": UCX where ucxx imports, can start
a context and a GPU is present, else TCP. On a CPU-only host TCP is the better default: with UCX
in the engine processes, `pdserve bench kv` measured a cold 2,048-token prefill 2.6x slower
(16.9 s vs 6.5 s: UCX's progress work competes with the forward on the engine's cores) and
store loads at 0.22 GB/s vs 0.77 GB/s over TCP (see UCX_NOTES.md). UCX's strengths (CUDA
memory, RDMA) need a GPU or a fabric.
"""

from __future__ import annotations

import logging
import os

from pdserve.connector.transport.base import (Connection, FrameRejected, FunctionHandler,
                                              Listener, Message, RemoteError, RequestHandler,
                                              Transport, TransportError)

TRANSPORT_KINDS = ("auto", "ucx", "tcp")
log = logging.getLogger(__name__)

__all__ = ["Connection", "FrameRejected", "FunctionHandler", "Listener", "Message",
           "RemoteError", "RequestHandler", "Transport", "TransportError", "TRANSPORT_KINDS",
           "UcxUnavailable", "make_transport", "ucx_available"]


class UcxUnavailable(RuntimeError):
    """transport="ucx" was asked for but ucxx cannot be imported or started here."""


def ucx_available() -> tuple[bool, str]:
    """(usable, why not): ucxx imports and a UCX context starts."""
    try:
        from pdserve.connector.transport.ucx import UcxConfig, ensure_initialized

        ensure_initialized(UcxConfig())
    except Exception as exc:  # ImportError, a missing libucx, a UCX config error, ...
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def gpu_present() -> bool:
    """An NVIDIA device node exists (checked without importing torch or CUDA)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def make_transport(kind: str = "auto") -> Transport:
    if kind not in TRANSPORT_KINDS:
        raise ValueError(f"transport must be one of {TRANSPORT_KINDS}, got {kind!r}")
    if kind == "auto" and not gpu_present():
        kind = "tcp"
    if kind in ("auto", "ucx"):
        ok, why = ucx_available()
        if ok:
            from pdserve.connector.transport.ucx import UcxTransport

            return UcxTransport()
        if kind == "ucx":
            raise UcxUnavailable(f"ucx transport unavailable: {why}")
        log.info("ucx unavailable (%s); using tcp", why)
    from pdserve.connector.transport.tcp import TcpTransport

    return TcpTransport()
