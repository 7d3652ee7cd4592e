"""The address of a Python buffer, for the ctypes calls that read it with the GIL released
(connector/poly1305.py, connector/transport/splice.py)."""

from __future__ import annotations

import ctypes
from typing import Union

import numpy as np

Buffer = Union[bytes, bytearray, memoryview]


def pinned_address(part: Buffer) -> tuple[object, int]:
    """(keep-alive, address) of a non-empty C-contiguous buffer: the address is valid while
    the keep-alive object lives. A writable view goes through ctypes (~1 us); a read-only one
    (bytes included) through numpy, which accepts read-only buffers."""
    view = memoryview(part)
    if not view.c_contiguous:  # the callee reads nbytes from one address
        raise ValueError("a buffer passed by address must be contiguous")
    if view.readonly:
        keep = np.frombuffer(view, dtype=np.uint8)
        return keep, keep.ctypes.data
    keep = ctypes.c_char.from_buffer(view)
    return keep, ctypes.addressof(keep)
