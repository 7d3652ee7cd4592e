"""The address of a Python buffer, for the ctypes calls that read it with the GIL released
(connector/poly1305.py, connector/transport/splice.py)."""

from __future__ import annotations

import ctypes
from typing import Union

import numpy as np

Buffer = Union[bytes, bytearray, memoryview]


def pinned_address(part: Buffer) -> tuple[object, int]:
    """(keep-alive, address) of a non-empty C-contiguous buffer: the address is valid while
    the keep-alive object lives. bytes and writable views go through ctypes (~1 us); other
    read-only views through numpy, which accepts them."""
    if isinstance(part, bytes):  # its own buffer, no copy (~1 us; numpy's way takes ~6)
        return part, ctypes.cast(ctypes.c_char_p(part), ctypes.c_void_p).value
    view = memoryview(part)
    if not view.c_contiguous:  # the callee reads nbytes from one address
        raise ValueError("a buffer passed by address must be contiguous")
    if view.readonly:
        keep = np.frombuffer(view, dtype=np.uint8)
        return keep, keep.ctypes.data
    keep = ctypes.c_char.from_buffer(view)
    return keep, ctypes.addressof(keep)
