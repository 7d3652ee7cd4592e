"""Block codec: one KV block (all layers) as bytes with a self-describing header.

Layout: header (struct below) || payload, payload = the block's K/V for every layer as
[layers, 2, block_size, kv_heads, head_dim] in the cache dtype. The header carries the format
version, the model fingerprint, the block key, the geometry and a MAC: NH-Poly1305, Poly1305
under a one-time key, HMAC-SHA256(block MAC key, label || nonce), over the header (tag zeroed,
nonce included), the payload's NH chunk hashes (connector/nh.py, under a key derived once from
the block MAC key) and the payload's length; the nonce, 16 random bytes, is carried in the
header's MAC field next to the 16-byte tag. The block MAC key is the
block secret's (connector/kvstore/auth.py). Decode rejects (BlockCodecError) any block whose
header does not match what the reader expects or whose MAC does not verify: a block altered
on a node or in flight, or forged by anyone without the key. A rejected block is never computed on.

NH-Poly1305 (version 5) and not GMAC (version 4), Poly1305 (3) or HMAC-SHA256 (2) over the
payload: NH runs on plain vector integer multiplies (11-14 GB/s per core with AVX2 on a 2-core
Zen 3 where GMAC ran 4-5), and Poly1305 then reads 1/32 of the bytes; a fresh PRF-derived key per
block is the one-time-authenticator pattern of ChaCha20-Poly1305 (and UMAC's: a fixed hash
key, a fresh mask per message); why it is sound is in docs/kvstore-security.md. Without a
block secret the MAC key is a public constant: still an integrity check, no longer an
authenticity one.
`header` and `decode` hash the payload with the GIL released (NH is a ctypes call; Poly1305
then holds it ~8 us per 0.7 MB block); the connector runs `header` on its I/O loop just
before a block is sent (save_io.InlineSeals) and `decode` on its I/O worker, never on the
engine thread.
"""

from __future__ import annotations

import hmac
import os
import struct
from dataclasses import dataclass, field

import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

from pdserve.connector.kvstore.auth import UNKEYED_MAC_KEY
from pdserve.connector.nh import derive_key, nh_chunks

MAGIC = b"PDKV"
# 2: HMAC-SHA256 replaced the CRC32; 3: Poly1305, one-time key per block; 4: GMAC, the same;
# 5: NH-Poly1305, the same
FORMAT_VERSION = 5
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_DTYPE_NAMES = {code: dtype for dtype, code in _DTYPES.items()}
# magic, version, dtype, block_size, layers, kv_heads, head_dim, fingerprint(32), key(32),
# payload bytes, mac(32) = nonce(16) || tag(16), padding to 128 bytes so the
# payload stays aligned for tensor views
_HEADER = struct.Struct("<4sHBIIII32s32sQ32s1x")
HEADER_SIZE = _HEADER.size
NONCE_BYTES = 16
_NO_TAG = bytes(16)
_OTK_LABEL = b"pdkv-nhpoly-otk\0"
_LENGTH = struct.Struct("<Q")


class BlockCodecError(ValueError):
    """A block that must not be used: wrong model, geometry, key, version, or corrupted."""


@dataclass(frozen=True)
class BlockCodec:
    fingerprint: str  # model fingerprint, sha256 hex
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    mac_key: bytes = field(default=UNKEYED_MAC_KEY, repr=False)  # BlockKeys.mac

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype}")
        if len(bytes.fromhex(self.fingerprint)) != 32:
            raise ValueError("fingerprint must be a sha256 hex digest")

    @property
    def payload_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_nbytes(self) -> int:
        n = 1
        for d in self.payload_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return HEADER_SIZE + self.payload_nbytes

    def _tag(self, nonce: bytes, unsigned_header: bytes, payload: memoryview) -> bytes:
        """The tag, under a Poly1305 key for this block alone, of the header, the payload's NH
        chunk hashes (1/32 of its bytes) and its length."""
        one_time_key = hmac.digest(self.mac_key, _OTK_LABEL + nonce, "sha256")  # HMAC-SHA256
        mac = Poly1305(one_time_key)  # over 1/32 of the payload: ~8 us of GIL for 0.7 MB
        mac.update(unsigned_header)
        mac.update(nh_chunks(derive_key(self.mac_key), payload))  # releases the GIL
        mac.update(_LENGTH.pack(memoryview(payload).nbytes))
        return mac.finalize()

    def header(self, key: bytes, payload: memoryview) -> bytes:
        """The header of a block holding `payload`, its MAC computed under a fresh nonce."""
        fields = [MAGIC, FORMAT_VERSION, _DTYPES[self.dtype], self.block_size,
                  self.num_layers, self.num_kv_heads, self.head_dim,
                  bytes.fromhex(self.fingerprint), key, len(payload)]
        nonce = os.urandom(NONCE_BYTES)  # never repeats: a repeated one-time key is forgeable
        tag = self._tag(nonce, _HEADER.pack(*fields, nonce + _NO_TAG), payload)
        return _HEADER.pack(*fields, nonce + tag)

    def encode_into(self, key: bytes, block: torch.Tensor, out: bytearray) -> memoryview:
        """block [layers, 2, bs, kvh, d] -> header || payload written into out (nbytes)."""
        view = self.write_payload(block, out)
        view[:HEADER_SIZE] = self.header(key, view[HEADER_SIZE:])
        return view

    def write_payload(self, block: torch.Tensor, out: bytearray) -> memoryview:
        """Copy block [layers, 2, bs, kvh, d] into out's payload region; the header is left
        for `header` (so its MAC can be computed elsewhere, e.g. on the I/O worker)."""
        if tuple(block.shape) != self.payload_shape or block.dtype != self.dtype:
            raise ValueError(f"block must be {self.payload_shape} {self.dtype}, got "
                             f"{tuple(block.shape)} {block.dtype}")
        view = memoryview(out)[:self.nbytes]
        dst = torch.frombuffer(view[HEADER_SIZE:], dtype=self.dtype).view(self.payload_shape)
        dst.copy_(block)
        return view

    def decode(self, key: bytes, data: memoryview) -> torch.Tensor:
        """Validated payload of data as a tensor [layers, 2, bs, kvh, d] (a view of data)."""
        if len(data) < HEADER_SIZE:
            raise BlockCodecError(f"block of {len(data)} bytes is shorter than its header")
        (magic, version, dtype, bs, layers, kvh, d, fp, got_key, n,
         mac) = _HEADER.unpack(bytes(data[:HEADER_SIZE]))  # the padding is not returned
        if data[HEADER_SIZE - 1] != 0:  # ... nor covered by the MAC: it must be as written
            raise BlockCodecError("block rejected: non-zero header padding")
        expected = (MAGIC, FORMAT_VERSION, _DTYPES[self.dtype], self.block_size,
                    self.num_layers, self.num_kv_heads, self.head_dim,
                    bytes.fromhex(self.fingerprint), key, self.payload_nbytes)
        got = (magic, version, dtype, bs, layers, kvh, d, fp, got_key, n)
        names = ("magic", "version", "dtype", "block_size", "layers", "kv_heads", "head_dim",
                 "model fingerprint", "key", "payload size")
        for name, want, have in zip(names, expected, got):
            if want != have:  # a dtype mismatch: written by an engine of another --kv-cache-dtype
                why = f" (block {_DTYPE_NAMES.get(have, have)}, reader {self.dtype})" \
                    if name == "dtype" else ""
                raise BlockCodecError(f"block rejected: {name} mismatch{why}")
        payload = data[HEADER_SIZE:HEADER_SIZE + n]
        if len(payload) != n:
            raise BlockCodecError("block rejected: truncated payload")
        nonce, tag = mac[:NONCE_BYTES], mac[NONCE_BYTES:]
        want = self._tag(nonce, _HEADER.pack(*got, nonce + _NO_TAG), payload)
        if not hmac.compare_digest(want, tag):  # constant time
            raise BlockCodecError("block rejected: MAC mismatch (altered, forged or "
                                  "corrupted)")
        return torch.frombuffer(payload, dtype=self.dtype).view(self.payload_shape)
