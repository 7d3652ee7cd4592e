"""GMAC tags (AES-256-GCM over associated data only) that release the GIL: OpenSSL's EVP_MAC
through ctypes, like connector/poly1305.py.

Used with a one-time key per message (connector/codec.py derives it from a per-block nonce),
so the fixed IV below never repeats under one key. Why GMAC and not Poly1305 for block MACs:
GHASH runs on the carry-less multiply (PCLMULQDQ) that every x86-64 server since 2010 and
every ARMv8 core with the crypto extension have, and on the 2-core AMD EPYC (AVX2, no AVX-512)
this project benches on it ran about twice as fast as OpenSSL's Poly1305 (2.3-3.2 against
1.4-1.6 GB/s of CPU time over 0.7-16 MiB). Soundness: docs/kvstore-security.md, "The block
MAC".

Where libcrypto 3 cannot be loaded, `gmac_tag` falls back to cryptography's AESGCM with the
message as associated data (identical tags; GIL held, one copy of the message).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Sequence

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pdserve.connector.cbuf import Buffer
from pdserve.connector.poly1305 import evp_mac

KEY_BYTES = 32  # AES-256
TAG_BYTES = 16
IV = bytes(12)  # one key, one message: the IV need not vary (see the module doc)
_UTF8_STRING, _OCTET_STRING = 4, 5  # OSSL_PARAM data types (openssl/core.h)
_UNMODIFIED = ctypes.c_size_t(-1).value  # OSSL_PARAM_UNMODIFIED


class _OsslParam(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("data_type", ctypes.c_uint),
                ("data", ctypes.c_void_p), ("data_size", ctypes.c_size_t),
                ("return_size", ctypes.c_size_t)]


@functools.lru_cache(maxsize=1)
def _params():
    """The OSSL_PARAM array (cipher, IV): read-only for OpenSSL, so shared by every call.
    Returned with the buffers it points into, which must outlive it."""
    cipher = ctypes.create_string_buffer(b"AES-256-GCM")
    iv = ctypes.create_string_buffer(IV, len(IV))
    params = (_OsslParam * 3)(
        _OsslParam(b"cipher", _UTF8_STRING, ctypes.cast(cipher, ctypes.c_void_p),
                   len(cipher.value), _UNMODIFIED),
        _OsslParam(b"iv", _OCTET_STRING, ctypes.cast(iv, ctypes.c_void_p), len(IV),
                   _UNMODIFIED),
        _OsslParam(None, 0, None, 0, 0))
    return params, (cipher, iv)


def releases_gil() -> bool:
    return evp_mac(b"GMAC") is not None


def gmac_tag(key: bytes, parts: Sequence[Buffer]) -> bytes:
    """GMAC(AES-256 key, IV, concatenation of parts): 16 bytes. `key`: a one-time key."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a GMAC key is {KEY_BYTES} bytes, got {len(key)}")
    evp = evp_mac(b"GMAC")
    if evp is not None:
        return evp.tag(key, parts, _params()[0])
    return AESGCM(key).encrypt(IV, b"", b"".join(bytes(p) for p in parts))
