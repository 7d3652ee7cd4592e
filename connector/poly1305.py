"""Poly1305 tags that release the GIL: OpenSSL's EVP_MAC through ctypes.

Why not cryptography's `Poly1305`: its `update` holds the GIL for the whole call (measured: a
thread doing Python work stalls for the full 0.7 s of a 256 MiB update), so a block's MAC
computed in a worker thread still stops the event loop that sends the previous block, and the
engine thread as well. A ctypes call releases the GIL, so here the MAC of one block runs on
one core while the previous block's bytes move on the other. Same algorithm, same library
(OpenSSL's AVX2 code), same tags: tests/unit/test_codec.py checks them against cryptography's.

Where the system's libcrypto 3 cannot be loaded, `poly1305_tag` falls back to cryptography
(identical tags, GIL held); `releases_gil()` says which one is in use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
from cryptography.hazmat.primitives.poly1305 import Poly1305

KEY_BYTES = 32
TAG_BYTES = 16
Buffer = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True)
class _EvpMac:
    """libcrypto's EVP_MAC entry points and the fetched POLY1305 algorithm (shared by threads:
    an EVP_MAC is read-only once fetched; each tag gets its own EVP_MAC_CTX)."""
    lib: ctypes.CDLL
    mac: int  # EVP_MAC *

    def tag(self, key: bytes, parts: Sequence[Buffer]) -> bytes:
        ctx = self.lib.EVP_MAC_CTX_new(self.mac)
        if not ctx:
            raise MemoryError("EVP_MAC_CTX_new failed")
        try:
            if self.lib.EVP_MAC_init(ctx, key, len(key), None) != 1:
                raise ValueError("EVP_MAC_init(POLY1305) failed")
            for part in parts:
                if len(part):
                    pinned = _Pinned(part)  # holds the buffer for the call
                    if self.lib.EVP_MAC_update(ctx, pinned.address, pinned.nbytes) != 1:
                        raise ValueError("EVP_MAC_update failed")
            out = ctypes.create_string_buffer(TAG_BYTES)
            outl = ctypes.c_size_t(0)
            if self.lib.EVP_MAC_final(ctx, out, ctypes.byref(outl), TAG_BYTES) != 1 \
                    or outl.value != TAG_BYTES:
                raise ValueError("EVP_MAC_final failed")
            return out.raw
        finally:
            self.lib.EVP_MAC_CTX_free(ctx)


class _Pinned:
    """The address of a non-empty contiguous buffer, valid while this object lives. bytes pass
    as themselves; a writable view through ctypes (~1 us); a read-only one through numpy."""

    def __init__(self, part: Buffer):
        if isinstance(part, bytes):
            self._keep, self.address, self.nbytes = part, part, len(part)
            return
        view = memoryview(part)
        if not view.c_contiguous:  # libcrypto reads nbytes from one address
            raise ValueError("a buffer to MAC must be contiguous")
        self.nbytes = view.nbytes
        if view.readonly:
            self._keep = np.frombuffer(view, dtype=np.uint8)
            self.address = self._keep.ctypes.data
        else:
            self._keep = ctypes.c_char.from_buffer(view)
            self.address = ctypes.addressof(self._keep)


def _bind(lib: ctypes.CDLL) -> _EvpMac:
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.EVP_MAC_fetch.restype = vp
    lib.EVP_MAC_fetch.argtypes = [vp, ctypes.c_char_p, ctypes.c_char_p]
    lib.EVP_MAC_CTX_new.restype = vp
    lib.EVP_MAC_CTX_new.argtypes = [vp]
    lib.EVP_MAC_init.argtypes = [vp, ctypes.c_char_p, sz, vp]
    lib.EVP_MAC_update.argtypes = [vp, vp, sz]
    lib.EVP_MAC_final.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(sz), sz]
    lib.EVP_MAC_CTX_free.argtypes = [vp]
    lib.EVP_MAC_CTX_free.restype = None
    mac = lib.EVP_MAC_fetch(None, b"POLY1305", None)
    if not mac:
        raise OSError("libcrypto has no POLY1305 MAC")
    return _EvpMac(lib, mac)


@functools.lru_cache(maxsize=1)
def _evp() -> Optional[_EvpMac]:
    """The binding, or None when no usable libcrypto 3 is found (loaded once per process)."""
    for name in ("libcrypto.so.3", ctypes.util.find_library("crypto")):
        if not name:
            continue
        try:
            return _bind(ctypes.CDLL(name))  # CDLL: every call releases the GIL
        except (OSError, AttributeError):  # not there, or an OpenSSL 1.x without EVP_MAC
            continue
    return None


def releases_gil() -> bool:
    return _evp() is not None


def poly1305_tag(key: bytes, parts: Sequence[Buffer]) -> bytes:
    """Poly1305(key, concatenation of parts): 16 bytes. `key` is a one-time key (32 bytes)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a Poly1305 key is {KEY_BYTES} bytes, got {len(key)}")
    evp = _evp()
    if evp is not None:
        return evp.tag(key, parts)
    mac = Poly1305(key)
    for part in parts:
        mac.update(part)
    return mac.finalize()
