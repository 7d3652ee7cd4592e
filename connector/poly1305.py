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
from typing import Optional, Sequence

from cryptography.hazmat.primitives.poly1305 import Poly1305

from pdserve.connector.cbuf import Buffer, pinned_address

KEY_BYTES = 32
TAG_BYTES = 16


@dataclass(frozen=True)
class EvpMac:
    """libcrypto's EVP_MAC entry points and one fetched algorithm (shared by threads: an
    EVP_MAC is read-only once fetched; each tag gets its own EVP_MAC_CTX)."""
    lib: ctypes.CDLL
    mac: int  # EVP_MAC *

    def tag(self, key: bytes, parts: Sequence[Buffer], params=None) -> bytes:
        """The MAC of the concatenated parts; `params`: an OSSL_PARAM array (gmac.py)."""
        ctx = self.lib.EVP_MAC_CTX_new(self.mac)
        if not ctx:
            raise MemoryError("EVP_MAC_CTX_new failed")
        try:
            if self.lib.EVP_MAC_init(ctx, key, len(key), params) != 1:
                raise ValueError("EVP_MAC_init failed")
            for part in parts:
                if len(part):
                    keep, address = pinned_address(part)  # keep holds the buffer
                    if self.lib.EVP_MAC_update(ctx, address, memoryview(part).nbytes) != 1:
                        raise ValueError("EVP_MAC_update failed")
                    del keep
            out = ctypes.create_string_buffer(TAG_BYTES)
            outl = ctypes.c_size_t(0)
            if self.lib.EVP_MAC_final(ctx, out, ctypes.byref(outl), TAG_BYTES) != 1 \
                    or outl.value != TAG_BYTES:
                raise ValueError("EVP_MAC_final failed")
            return out.raw
        finally:
            self.lib.EVP_MAC_CTX_free(ctx)


def _bind(lib: ctypes.CDLL, name: bytes) -> EvpMac:
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
    mac = lib.EVP_MAC_fetch(None, name, None)
    if not mac:
        raise OSError(f"libcrypto has no {name.decode()} MAC")
    return EvpMac(lib, mac)


@functools.lru_cache(maxsize=4)
def evp_mac(name: bytes = b"POLY1305") -> Optional[EvpMac]:
    """The binding of MAC `name`, or None when no usable libcrypto 3 is found (loaded once
    per process and name)."""
    for lib in ("libcrypto.so.3", ctypes.util.find_library("crypto")):
        if not lib:
            continue
        try:
            return _bind(ctypes.CDLL(lib), name)  # CDLL: every call releases the GIL
        except (OSError, AttributeError):  # not there, or an OpenSSL 1.x without EVP_MAC
            continue
    return None


def releases_gil() -> bool:
    return evp_mac() is not None


def poly1305_tag(key: bytes, parts: Sequence[Buffer]) -> bytes:
    """Poly1305(key, concatenation of parts): 16 bytes. `key` is a one-time key (32 bytes)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a Poly1305 key is {KEY_BYTES} bytes, got {len(key)}")
    evp = evp_mac()
    if evp is not None:
        return evp.tag(key, parts)
    mac = Poly1305(key)
    for part in parts:
        mac.update(part)
    return mac.finalize()
