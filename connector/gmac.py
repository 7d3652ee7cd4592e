"""GMAC tags (AES-256-GCM over associated data only) through cryptography's GCM encryptor.

Used with a one-time key per message (connector/codec.py derives it from a per-block nonce),
so the fixed IV below never repeats under one key. Why GMAC and not Poly1305 for block MACs:
GHASH runs on the carry-less multiply (PCLMULQDQ) that every x86-64 server since 2010 and
every ARMv8 core with the crypto extension have. Soundness: docs/kvstore-security.md, "The
block MAC".

Why cryptography's encryptor and not the system's libcrypto through ctypes (what this module
did before): the OpenSSL that cryptography's wheel carries (4.x) hashes a 0.7 MiB block at
21-23 GB/s of CPU time on the 2-core Zen 5 this project benches on, where Debian's libcrypto
3.0 ran 5.3-8 GB/s (not traced; likely its GHASH path without VPCLMULQDQ here), so the
MAC costs ~33 us per SmolLM2 block instead of ~110. The price: the call holds the GIL. Each
`authenticate_additional_data` gets at most PIECE_BYTES (~12 us), so no other thread waits
long on one call; callers run the MAC inline where they are (connector/save_io.py) rather
than on a worker, as a hand-off would cost more than the MAC.
"""

from __future__ import annotations

from typing import Sequence

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from pdserve.connector.cbuf import Buffer

KEY_BYTES = 32  # AES-256
TAG_BYTES = 16
IV = bytes(12)  # one key, one message: the IV need not vary (see the module doc)
PIECE_BYTES = 256 << 10  # the most one GIL-holding call hashes


def gmac_tag(key: bytes, parts: Sequence[Buffer]) -> bytes:
    """GMAC(AES-256 key, IV, concatenation of parts): 16 bytes. `key`: a one-time key."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a GMAC key is {KEY_BYTES} bytes, got {len(key)}")
    gcm = Cipher(algorithms.AES(key), modes.GCM(IV)).encryptor()
    for part in parts:
        view = memoryview(part)
        if not view.c_contiguous:
            raise ValueError("a MAC'd buffer must be contiguous")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        for at in range(0, len(view), PIECE_BYTES):
            gcm.authenticate_additional_data(view[at:at + PIECE_BYTES])
    gcm.finalize()  # no plaintext: the tag covers the associated data alone
    return gcm.tag
