"""NH chunk hashes for the block MAC (connector/codec.py, format version 5).

NH is the universal hash of UMAC and Adiantum; this is Adiantum's variant (4 passes, 32-bit
words, stride 2, 1024-byte chunks, a 1072-byte key), checked against Adiantum's published
test vectors (tests/unit/test_nh.py). It is not a MAC by itself: the codec feeds the chunk
hashes (32 bytes per KiB of payload) to Poly1305 under a one-time key, as Adiantum's
NH-Poly1305 does, so the slow part of a MAC runs over 1/32 of the bytes. Why NH: its inner
loop is a 32-bit add and a 32x32->64 multiply per word pair, no carry-less multiply: 11-14
GB/s per core with AVX2 (2.5-3.4 in portable C) on the Zen 3 this project benched on, where
GMAC ran at 4-5; an AVX-512 loop runs where the kernels build for AVX-512. See
docs/kvstore-security.md, "The block MAC".

The loops are C (connector/native/nh.c), compiled once per source version into the kernel
cache (`kernel_cache_root`, as the attention kernels are) and called through ctypes, so a call
releases the GIL. Where no C compiler works, `nh_reference` (numpy, the specification, ~100x
slower) computes the same bytes and one warning is logged. `PDSERVE_CPU_ISA` (the kernels'
ISA cap) chooses the loop: `avx2` the AVX2 one, `scalar` the portable one.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import hmac
import logging
import os
import platform
import subprocess
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from pdserve.connector.cbuf import Buffer, pinned_address

log = logging.getLogger(__name__)

PASSES = 4
UNIT_BYTES = 16
CHUNK_BYTES = 1024
HASH_BYTES = 8 * PASSES  # one chunk's hash: four little-endian u64
KEY_BYTES = CHUNK_BYTES + UNIT_BYTES * (PASSES - 1)  # 1072
_SOURCE = Path(__file__).resolve().parent / "native" / "nh.c"
_KEY_LABEL = b"pdkv-nh-key\0"


def hashes_nbytes(nbytes: int) -> int:
    """Bytes of chunk hashes for a message of `nbytes`."""
    return -(-nbytes // CHUNK_BYTES) * HASH_BYTES


@functools.lru_cache(maxsize=8)
def derive_key(mac_key: bytes) -> np.ndarray:
    """The NH key of a block MAC key: KEY_BYTES of HMAC-SHA256(mac_key, label || counter)
    as uint32 words [268] (read-only; computed once per process and key)."""
    stream = b"".join(hmac.digest(mac_key, _KEY_LABEL + bytes([i]), "sha256")
                      for i in range(-(-KEY_BYTES // 32)))
    words = np.frombuffer(stream[:KEY_BYTES], dtype="<u4").copy()
    words.flags.writeable = False
    return words


def nh_reference(key: np.ndarray, msg: Buffer) -> bytes:
    """The chunk hashes of msg, in numpy: the definition the C loops must equal."""
    data = np.frombuffer(memoryview(msg).cast("B"), dtype=np.uint8)
    full = len(data) // CHUNK_BYTES * CHUNK_BYTES
    parts = [_reference_chunks(key, data[:full].view("<u4").reshape(-1, CHUNK_BYTES // 16, 4))]
    if full < len(data):  # a last, shorter chunk; its partial unit zero-padded
        tail = np.zeros(-(-(len(data) - full) // UNIT_BYTES) * UNIT_BYTES, dtype=np.uint8)
        tail[:len(data) - full] = data[full:]
        parts.append(_reference_chunks(key, tail.view("<u4").reshape(1, -1, 4)))
    return b"".join(parts)


def _reference_chunks(key: np.ndarray, m: np.ndarray) -> bytes:
    """m [chunks, units, 4] uint32 words -> the chunks' hashes."""
    sums = np.empty((m.shape[0], PASSES), dtype="<u8")
    for p in range(PASSES):
        k = key[4 * p:4 * p + m.shape[1] * 4].reshape(-1, 4)  # [units, 4]
        t = (m + k).astype(np.uint64)  # the u32 sums wrap, as in C
        sums[:, p] = (t[..., 0] * t[..., 2] + t[..., 1] * t[..., 3]).sum(axis=1, dtype=np.uint64)
    return sums.tobytes()


def nh_chunks(key: np.ndarray, msg: Buffer) -> bytes:
    """The chunk hashes of msg (hashes_nbytes(len) bytes) under key (derive_key's words)."""
    native = _native()
    if native is None:
        return nh_reference(key, msg)
    return native(key, msg)


def native_available() -> bool:
    """Whether the C loops are in use (built now if they never were)."""
    return _native() is not None


class Isa(enum.IntEnum):
    """The loops of nh.c, as its `isa` argument numbers them."""

    SCALAR = 0
    AVX2 = 1
    AVX512 = 2


def best_isa() -> Isa:
    """The widest loop this CPU runs under the kernels' ISA cap (PDSERVE_CPU_ISA)."""
    from pdserve.common.attention.cpu_native import compile_flags  # the one ISA setting

    flags = compile_flags()
    if "-mavx512f" in flags:
        return Isa.AVX512
    return Isa.AVX2 if "-mavx2" in flags else Isa.SCALAR


@functools.lru_cache(maxsize=1)
def _native() -> Optional[Callable[[np.ndarray, Buffer], bytes]]:
    try:
        fn = bind_entry(_load_library())
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("native NH unavailable (%s): block MACs use the numpy path, ~100x slower",
                    e)
        return None
    isa = int(best_isa())

    def call(key: np.ndarray, msg: Buffer) -> bytes:
        n = memoryview(msg).nbytes
        out = bytearray(hashes_nbytes(n))
        if n:
            keep, address = pinned_address(msg)
            fn(key.ctypes.data, address, n, ctypes.addressof(
                ctypes.c_char.from_buffer(out)), isa)  # the GIL is released in here
            del keep
        return bytes(out)
    return call


def bind_entry(lib: ctypes.CDLL):
    """The library's `pdserve_nh_chunks(key, msg, len, out, isa) -> bytes written`, typed
    (isa: an `Isa`)."""
    fn = lib.pdserve_nh_chunks
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                   ctypes.c_int]
    return fn


def _load_library() -> ctypes.CDLL:
    """libpdserve_nh.so from the kernel cache, compiled first if this source never was."""
    from pdserve.common.attention.cpu_native import kernel_cache_root

    source = _SOURCE.read_bytes()
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256(source + repr((compiler, platform.machine())).encode())
    directory = kernel_cache_root() / f"pdserve_nh_{digest.hexdigest()[:16]}"
    library = directory / "libpdserve_nh.so"
    if not library.exists():
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".build-{os.getpid()}.so"  # concurrent builders never collide
        subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", str(partial), str(_SOURCE)],
                       check=True, capture_output=True, timeout=120)
        os.replace(partial, library)
    return ctypes.CDLL(str(library))
