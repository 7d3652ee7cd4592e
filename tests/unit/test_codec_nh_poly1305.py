"""The block MAC of format version 5 is exactly NH-Poly1305 as docs/kvstore-security.md states
it, and any changed bit of a block, in any chunk, is refused."""

import hmac
import struct

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

from pdserve.connector import nh
from pdserve.connector.codec import FORMAT_VERSION, HEADER_SIZE, BlockCodec, BlockCodecError

MAC_KEY = b"m" * 32
KEY = b"b" * 32


def _codec() -> BlockCodec:  # a payload of 2 * 2 * 16 * 3 * 64 * 4 = 49,152 bytes: 48 chunks
    return BlockCodec("0f" * 32, 2, 16, 3, 64, mac_key=MAC_KEY)


def _encoded(codec: BlockCodec) -> bytearray:
    buf = bytearray(codec.nbytes)
    block = torch.from_numpy(np.random.default_rng(0).standard_normal(
        codec.payload_shape, dtype=np.float32))
    codec.encode_into(KEY, block, buf)
    return buf


def test_the_tag_is_poly1305_of_header_nh_hashes_and_length():
    codec = _codec()
    buf = _encoded(codec)
    assert FORMAT_VERSION == 5
    header, payload = bytes(buf[:HEADER_SIZE]), bytes(buf[HEADER_SIZE:])
    nonce, tag = header[-33:-17], header[-17:-1]  # the MAC field, then one padding byte
    unsigned = header[:-17] + bytes(16) + header[-1:]
    otk = hmac.digest(MAC_KEY, b"pdkv-nhpoly-otk\0" + nonce, "sha256")
    mac = Poly1305(otk)
    mac.update(unsigned)
    mac.update(nh.nh_reference(nh.derive_key(MAC_KEY), payload))
    mac.update(struct.pack("<Q", len(payload)))
    assert mac.finalize() == tag
    assert codec.decode(KEY, memoryview(buf)).shape == codec.payload_shape


@pytest.mark.parametrize("at", [0, 5, HEADER_SIZE - 2, HEADER_SIZE, HEADER_SIZE + 1023,
                                HEADER_SIZE + 1024, HEADER_SIZE + 30_001, -1])
def test_any_flipped_bit_is_refused(at):
    codec = _codec()
    buf = _encoded(codec)
    buf[at] ^= 0x01
    with pytest.raises(BlockCodecError):
        codec.decode(KEY, memoryview(buf))


def test_a_swap_of_two_chunks_is_refused():
    """NH restarts its key at every chunk, so the chunk hashes carry the order: Poly1305 over
    them is what binds each chunk to its place."""
    codec = _codec()
    buf = _encoded(codec)
    first = bytes(buf[HEADER_SIZE:HEADER_SIZE + 1024])
    buf[HEADER_SIZE:HEADER_SIZE + 1024] = buf[HEADER_SIZE + 1024:HEADER_SIZE + 2048]
    buf[HEADER_SIZE + 1024:HEADER_SIZE + 2048] = first
    with pytest.raises(BlockCodecError, match="MAC mismatch"):
        codec.decode(KEY, memoryview(buf))
